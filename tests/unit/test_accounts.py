"""gpulab.hub.machine.accounts: the hub user -> account / folder / group name mapping is injective,
and an account or folder made for somebody else is never handed out."""

import os
import pwd

import pytest

from gpulab.hub.machine.accounts import (
    AccountConflict,
    account_comment,
    check_account,
    prepare_user_folder,
    safe_name,
    safe_slug,
    server_slug,
    server_stem,
    system_username,
)


@pytest.mark.parametrize("name", ["ann", "bob_2", "dave-x", "x-default", "a-", "0day"])
def test_plain_names_stay_as_they_are(name):
    assert safe_slug(name) == name
    assert system_username("jupyter-", name) == "jupyter-" + name


@pytest.mark.parametrize("name", ["carol.x", "Ann", "a--b", "-a", "é", "", "a b", "x" * 30])
def test_other_names_are_escaped_with_the_marker_and_a_hash(name):
    slug = safe_slug(name, 24)
    assert "---" in slug and len(slug) <= 24
    assert slug != name


def test_an_escaped_name_is_never_another_users_plain_name():
    """The attack of issue 12 item 2: sign up as exactly carol.x's mapped name."""
    victim = safe_slug("carol.x")
    assert safe_slug(victim) != victim  # it contains "--": escaped again, differently
    names = ["carol.x", victim, "carol-x", "Carol.X", "carol_x", "carol-x-", "a--b", "a-b",
             "x" * 40, "x" * 41, "x" * 23, "x" * 24, "x" * 25, "default", "", "u.1", "u-1"]
    for fn in (safe_slug, lambda n: system_username("jupyter-", n), server_slug):
        mapped = [fn(n) for n in names]
        assert len(set(mapped)) == len(names), mapped


def test_account_names_fit_linux(tmp_path):
    for name in ("x" * 100, "carol.x" * 10, "ü" * 40):
        assert len(system_username("jupyter-", name)) <= 32
    with pytest.raises(ValueError):
        system_username("p" * 25, "carol.x")


def test_server_slugs_keep_default_for_the_default_server():
    assert server_slug("") == "default"
    assert server_slug("default") != "default"
    assert server_slug("gpu") == "gpu"


def test_the_comment_records_the_hub_user():
    assert account_comment("carol.x") == "gpulab user carol.x"
    for odd_name in ("a:b,c\nd", "dr:who", "x" * 101):
        odd = account_comment(odd_name)
        # useradd refuses ':' and newlines in a comment (issue 33 item 7: such names could
        # never start anything); ',' separates GECOS fields
        assert odd.startswith("gpulab user sha256=") and not set(odd) & set(":,\n"), odd
    # no name recorded as it is looks like the hash of another
    assert account_comment("sha256=" + "0" * 64) != "gpulab user sha256=" + "0" * 64


def test_server_names_fit_a_file_name():
    """Names of any length make file, folder and group names within Linux's 255 bytes,
    still one-to-one (issue 33 item 7: long names never started)."""
    names = ["ann", "x" * 100, "x" * 101, "x" * 128, "x" * 300, "dr:who@lab", "é" * 200]
    stems = {(u, s): server_stem(u, s) for u in names for s in ("", "gpu", "y" * 200)}
    assert len(set(stems.values())) == len(stems)
    assert max(len(v) for v in stems.values()) + len(".log") <= 255
    assert server_stem("ann", "") == "ann.default" and server_stem("ann", "gpu") == "ann.gpu"
    assert safe_name("x" * 255) == "x" * 255  # as before: a plain name's folder keeps its name
    assert len(safe_name("x" * 256)) <= 255 and len(safe_name("é" * 300)) <= 255


def entry(name, gecos, uid=1234):
    return pwd.struct_passwd((name, "x", uid, uid, gecos, "/home/" + name, "/bin/bash"))


def test_an_account_made_for_another_hub_user_is_refused():
    mine = entry("jupyter-carol-x---bcd7a896", "gpulab user carol.x")
    assert check_account(mine, "carol.x") is mine
    with pytest.raises(AccountConflict, match="made for another hub user"):
        check_account(mine, "carol-x---bcd7a896")
    with pytest.raises(AccountConflict, match="not by gpulab"):
        check_account(entry("jupyter-root", "a person"), "root")
    with pytest.raises(AccountConflict):
        check_account(entry("jupyter-x", "gpulab user x", uid=0), "x")


@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")
def test_a_folder_of_another_account_is_refused(tmp_path):
    nobody = pwd.getpwnam("nobody")
    folder = tmp_path / "carol"
    folder.mkdir()
    os.chown(folder, nobody.pw_uid, nobody.pw_gid)
    me = entry("jupyter-x", "gpulab user x", uid=4242)
    with pytest.raises(AccountConflict, match="belongs to another account"):
        prepare_user_folder(folder, me)
    assert folder.stat().st_uid == nobody.pw_uid
    # the hub's own folder (made before users were isolated) is taken over
    mine = tmp_path / "x"
    mine.mkdir(mode=0o755)
    prepare_user_folder(mine, me)
    st = mine.stat()
    assert (st.st_uid, st.st_mode & 0o777) == (4242, 0o700)
    # a link is not a folder
    (tmp_path / "link").symlink_to(folder)
    with pytest.raises(Exception, match="Could not prepare"):
        prepare_user_folder(tmp_path / "link", me)
