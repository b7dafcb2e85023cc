"""run_python's forked snippets (tests/preimported.py) against fresh interpreters: what a test reads of a snippet (its
stdout, stderr, exit code, ``__main__``, arguments, environment, working directory) is the same."""
from __future__ import annotations

import os

from conftest import run_python

PRELUDE = """
import os, sys
seen = sorted(n for n in dir() if not n.startswith("__"))
print("prelude")  # a prelude reads no arguments (the code after it does)
print("prelude to stderr", file=sys.stderr)
"""
CODE = """
import atexit, json
atexit.register(lambda: print("at exit"))
print(json.dumps({"argv": sys.argv, "name": __name__, "seen": seen, "cwd": os.getcwd(),
                  "var": os.environ.get("PREIMPORTED_VAR"), "test": bool(os.environ.get("PYTEST_CURRENT_TEST")),
                  "main": sorted(n for n in vars(sys.modules["__main__"]) if not n.startswith("__")),
                  "stdin": sys.stdin.read()}))
if sys.argv[1] == "exit":
    sys.exit(int(sys.argv[2]))
if sys.argv[1] == "raise":
    raise ValueError("from the snippet")
"""


def both(args, **kw):
    forked = run_python(CODE, prelude=PRELUDE, args=args, check=False, **kw)
    fresh = run_python(PRELUDE + CODE, args=args, check=False, **kw)
    return forked, fresh


def test_a_forked_snippet_prints_exits_and_sees_what_a_fresh_interpreter_does(tmp_path):
    for args in (("plain",), ("exit", "3"), ("exit", "0"), ("raise",)):
        forked, fresh = both(args, env={"PREIMPORTED_VAR": "x"}, cwd=tmp_path)
        assert forked.returncode == fresh.returncode, (args, forked, fresh)
        assert forked.stdout == fresh.stdout, args
        if args[0] == "raise":  # the traceback's last line (its line numbers count from the code's first line)
            assert forked.stderr.splitlines()[-1] == fresh.stderr.splitlines()[-1] == "ValueError: from the snippet"
            assert forked.stderr.startswith("prelude to stderr\n")
        else:
            assert forked.stderr == fresh.stderr, args
    assert forked.returncode == 1 and '"argv": ["-c", "raise"]' in forked.stdout and "at exit" in forked.stdout
    assert f'"cwd": "{tmp_path}"' in forked.stdout and '"var": "x"' in forked.stdout and '"test": true' in forked.stdout


def test_another_environment_or_folder_is_another_server(tmp_path):
    import preimported

    before = len(preimported._servers)
    for env in ({"PREIMPORTED_VAR": "a"}, {"PREIMPORTED_VAR": "b"}):
        for cwd in (tmp_path, os.getcwd()):
            forked, fresh = both(("plain",), env=env, cwd=cwd)
            assert forked.stdout == fresh.stdout and f'"var": "{env["PREIMPORTED_VAR"]}"' in forked.stdout
    assert len(preimported._servers) == before + 4
