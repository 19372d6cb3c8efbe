#!/usr/bin/env bash
# Source this: defines find_python X.Y, which prints the path of an interpreter of exactly that
# minor version and returns 0, or prints nothing and returns 1. Where it looks, in order:
# $PYTHON<major><minor> (e.g. PYTHON312) if set, pythonX.Y on PATH, a pyenv-installed X.Y.
# scripts/ci_leg.sh uses it; it says which leg needs what when nothing is found.
find_python() {
    local want=$1 var="PYTHON${1/./}" cand v root
    for cand in "${!var:-}" "python$want"; do
        if [ -n "$cand" ] && command -v "$cand" >/dev/null 2>&1 && "$cand" -c "import sys; sys.exit(sys.version_info[:2] != tuple(map(int, '$want'.split('.'))))" 2>/dev/null; then
            command -v "$cand"; return 0
        fi
    done
    if command -v pyenv >/dev/null 2>&1; then
        root=$(pyenv root)
        for v in $(pyenv versions --bare 2>/dev/null | grep -E "^${want//./\\.}\.[0-9]+$" | sort -V -r); do
            [ -x "$root/versions/$v/bin/python" ] && { echo "$root/versions/$v/bin/python"; return 0; }
        done
    fi
    return 1
}
