"""What a person does in a notebook, shared by the browser tests."""

import re

# a cell's prompt once the kernel took it: `[*]:` while it runs, `[1]:` when done
TAKEN = re.compile(r"\[[0-9*]+\]")


def wait_for_kernel(page, timeout=120_000):
    """A person waits until the notebook's kernel shows Idle before running a cell (a cold
    kernel start takes a while on a loaded machine)."""
    # the shown notebook's (another notebook open in a tab behind has one too, hidden)
    page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']:visible").first.wait_for(
        timeout=timeout)
    page.locator(".jp-StatusBar-Widget", has_text="Idle").first.wait_for(timeout=timeout)


def type_into(page, cell, code: str, paste: bool = False):
    """Type `code` into `cell`'s editor (or, with `paste`, insert it whole, as a paste does:
    no auto-indentation of a long program) and check the editor holds exactly that (no lost
    or auto-inserted characters)."""
    editor = cell.locator(".cm-content")
    editor.click()
    if paste:
        page.keyboard.insert_text(code)
    else:
        page.keyboard.type(code)
    typed = editor.evaluate(
        "e => Array.from(e.querySelectorAll('.cm-line')).map(l => l.textContent).join('\\n')")
    assert typed == code, typed


def run(page, cell, attempts=3, timeout=30_000):
    """Run `cell` (Ctrl+Enter) and wait until the kernel took it (its prompt gets `*` or a
    number). JupyterLab can drop a request sent while a just-started kernel's connection is
    still settling: the prompt then stays `[ ]:`, and a person runs the cell again."""
    for attempt in range(attempts):
        cell.locator(".cm-content").click()
        page.keyboard.press("Control+Enter")
        try:
            cell.locator(".jp-InputPrompt").filter(has_text=TAKEN).wait_for(timeout=timeout)
            return cell
        except Exception:
            if attempt == attempts - 1:
                raise


def run_cell(page, code: str, index: int, paste: bool = False):
    """Type (or paste) `code` into cell `index` of the notebook opened last, run it, and
    leave a fresh cell below."""
    cells = page.locator(".jp-Notebook").last.locator(".jp-Cell")
    cell = cells.nth(index)
    type_into(page, cell, code, paste)
    run(page, cell)
    if cells.count() == index + 1:
        page.keyboard.press("Escape")
        page.keyboard.press("b")
    return cell
