"""What the kubelet does to a container's ``command``, ``args`` and ``env`` values before it
starts the process: ``$(NAME)`` becomes the value of the variable NAME, ``$$`` becomes ``$``
(Kubernetes' third_party/forked/golang/expansion/expand.go, line by line), so that tests can
show what a replica really runs. A reference to an unknown variable stays as written."""

from __future__ import annotations

from collections.abc import Mapping


def expand(text: str, env: Mapping[str, str]) -> str:
    out = []
    checkpoint = 0
    cursor = 0
    while cursor < len(text):
        if text[cursor] == "$" and cursor + 1 < len(text):
            out.append(text[checkpoint:cursor])
            rest = text[cursor + 1:]
            if rest[0] == "$":  # escaped operator
                read, is_var, advance = "$", False, 1
            elif rest[0] == "(":
                close = rest.find(")", 1)
                if close >= 1:
                    read, is_var, advance = rest[1:close], True, close + 1
                else:  # incomplete reference
                    read, is_var, advance = "$(", False, 1
            else:
                read, is_var, advance = "$" + rest[0], False, 1
            out.append((env[read] if read in env else f"$({read})") if is_var else read)
            cursor += advance
            checkpoint = cursor + 1
        cursor += 1
    return "".join(out) + text[checkpoint:]
