"""Activation without code changes: environment parsing, the .pth file, ``zerofix run``."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from conftest import ROOT, run_python
from zerofix import catalogue
from zerofix.activation import ConfigError, read_environment
from zerofix.cli import BOOTSTRAP_DIR, run_environment

FIX = catalogue.ids()[0]


@pytest.mark.parametrize("value", [None, "", "0", "false", "OFF", " no "])
def test_off_values(value):
    env = {} if value is None else {"ZEROFIX": value}
    assert read_environment(env).enabled is False


@pytest.mark.parametrize("value", ["1", "all", "TRUE", "on"])
def test_all_values(value):
    s = read_environment({"ZEROFIX": value})
    assert s.enabled and s.fixes is None


def test_id_lists_and_disable():
    s = read_environment({"ZEROFIX": f" {FIX} ,", "ZEROFIX_DISABLE": FIX, "ZEROFIX_LOG": "INFO",
                          "ZEROFIX_STRICT": "1"})
    assert s.fixes == (FIX,) and s.disable == (FIX,) and s.log_level == "info" and s.strict


def test_bootstrap_default_is_on_but_zero_still_wins():
    assert read_environment({}, default_on=True).enabled
    assert not read_environment({"ZEROFIX": "0"}, default_on=True).enabled


@pytest.mark.parametrize("env, words", [
    ({"ZEROFIX": "yes-please"}, ["ZEROFIX=1", "ZEROFIX=0", FIX]),
    ({"ZEROFIX": "1", "ZEROFIX_DISABLE": "nope"}, ["ZEROFIX_DISABLE=a comma list", FIX]),
])
def test_malformed_values_name_the_valid_forms(env, words):
    with pytest.raises(ConfigError) as info:
        read_environment(env)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_the_disable_warning_lists_no_form_it_rejects():
    with pytest.raises(ConfigError) as info:
        read_environment({"ZEROFIX": "1", "ZEROFIX_DISABLE": "nope"})
    assert "ZEROFIX_DISABLE=1" not in str(info.value) and "ZEROFIX_DISABLE=0" not in str(info.value)
    for rejected in ("1", "0"):
        with pytest.raises(ConfigError):
            read_environment({"ZEROFIX": "1", "ZEROFIX_DISABLE": rejected})


@pytest.mark.parametrize("env, words", [
    ({"ZEROFIX_LOG": "bogus"}, ["ZEROFIX_LOG='bogus'", "debug, info, warning", "still apply"]),
    ({"ZEROFIX_STRICT": "maybe"}, ["ZEROFIX_STRICT='maybe'", "1 or 0", "still apply"]),
    ({"ZEROFIX_LOSS_IS_SCALED_FOR_GA": "perhaps"}, ["ZEROFIX_LOSS_IS_SCALED_FOR_GA='perhaps'", "1:", "0:", "ignored"]),
])
def test_a_typo_in_an_optional_setting_warns_and_keeps_fixing(env, words):
    settings = read_environment({"ZEROFIX": "1", **env})
    assert settings.enabled and settings.fixes is None and not settings.strict and settings.log_level is None
    assert all(w in settings.warnings[0] for w in words), settings.warnings
    proc = run_python("""
        import zerofix.activation as a, zerofix.patching as p
        a.autopatch()
        print(sorted(p._enabled) == sorted(__import__("zerofix").catalogue.default_ids()))
    """, env={"ZEROFIX": "1", **env})
    assert proc.stdout.strip().endswith("True"), proc.stdout + proc.stderr
    assert proc.stderr.count("zerofix: warning:") == 1 and "activated no fix" not in proc.stderr, proc.stderr


def test_malformed_value_at_startup_warns_once_and_patches_nothing():
    proc = run_python("""
        import sys, zerofix.activation as a
        a.autopatch(); a.autopatch()   # the .pth already ran it once; no second warning
        print("zerofix.patching" in sys.modules)
    """, env={"ZEROFIX": "everything"})
    assert proc.stdout.strip() == "False"
    assert proc.stderr.count("zerofix: warning:") == 1, proc.stderr
    assert "ZEROFIX='everything' is not valid" in proc.stderr and "the environment activated no fix" in proc.stderr


def test_a_warning_is_said_once_per_process_tree(tmp_path):
    """Issue 42: under zerofix run (the launcher's start-up, then the child's) and torchrun (every rank) the same
    warning came once per process; it comes once, from the first process that reads the environment."""
    proc = run_python("""
        import subprocess, sys
        subprocess.run([sys.executable, "-c", "pass"])
        subprocess.run([sys.executable, "-c", "pass"])
    """, env={"ZEROFIX": "1", "ZEROFIX_FIXES": "x"})
    assert proc.stderr.count("ZEROFIX_FIXES is not a zerofix variable") == 1, proc.stderr


def test_pth_file_is_installed_in_site_packages():
    pth = Path(sysconfig.get_paths()["purelib"]) / "zerofix-autopatch.pth"
    assert pth.read_text() == (ROOT / "zerofix" / "_bootstrap" / "zerofix-autopatch.pth").read_text()
    assert len(pth.read_text().strip().splitlines()) == 1


def test_regular_wheel_ships_the_pth_at_its_root(tmp_path):
    # Built from a copy: a build in the checkout leaves build/ and *.egg-info behind.
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".venvs", ".git", "build", "*.egg-info", "__pycache__", "tests", "benchmarks", "constraints"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path), str(src)], check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("zerofix-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    record = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("RECORD"))).decode()
    assert "zerofix-autopatch.pth" in names and "zerofix-autopatch.pth," in record
    assert "zerofix/_bootstrap/sitecustomize.py" in names
    # issue 42: the metadata says Apache-2.0; the wheel carries the licence's text too
    assert any(n.endswith(".dist-info/licenses/LICENSE") or n.endswith(".dist-info/LICENSE") for n in names), names
    # issue 42: an author, and a long description whose links do not point into a repository it is not in
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "Author: the zerofix developers" in metadata
    description = metadata.split("\n\n", 1)[1]
    assert "## Quick start, from a checkout" in description
    assert not re.findall(r"\]\((?!https?:|#)[^)]*\)", description)
    assert "`docs/check.md` in the source distribution" in description


def test_zerofix_run_activates_and_chains_an_existing_sitecustomize(tmp_path):
    (tmp_path / "sitecustomize.py").write_text("import builtins; builtins.USER_SITECUSTOMIZE = True\n")
    code = ("import sys, builtins; print(getattr(builtins, 'USER_SITECUSTOMIZE', False), "
            "'zerofix.patching' in sys.modules, sys.modules['sitecustomize'].__file__)")
    env = {"PYTHONPATH": str(tmp_path)}
    out = run_python(f"import os, sys; os.execv(sys.executable, [sys.executable, '-m', 'zerofix', 'run', '--', "
                     f"sys.executable, '-c', {code!r}])", env=env).stdout.split()
    assert out[:2] == ["True", "True"], out
    assert out[2] == str(tmp_path / "sitecustomize.py")


def test_zerofix_run_respects_zerofix_0(tmp_path):
    out = run_python("import os, sys; os.execv(sys.executable, [sys.executable, '-m', 'zerofix', 'run', '--', "
                     "sys.executable, '-c', \"import sys; print('zerofix.patching' in sys.modules)\"])",
                     env={"ZEROFIX": "0"}).stdout
    assert out.strip() == "False"


def test_zerofix_run_rejects_unknown_ids_before_starting_anything():
    proc = subprocess.run([sys.executable, "-m", "zerofix", "run", "--fixes", "nope", "--", "true"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "nope" in proc.stderr and FIX in proc.stderr


@pytest.mark.parametrize("kind, code", [("not-executable", 126), ("directory", 126), ("missing", 127)])
def test_zerofix_run_with_a_command_it_cannot_start_says_why(tmp_path, kind, code):
    target = tmp_path / kind
    if kind == "not-executable":
        target.write_text("#!/bin/sh\necho hi\n")
    elif kind == "directory":
        target.mkdir()
    proc = subprocess.run([sys.executable, "-m", "zerofix", "run", "--", str(target)], capture_output=True,
                          text=True)
    assert proc.returncode == code, proc.stderr
    assert "Traceback" not in proc.stderr and str(target) in proc.stderr, proc.stderr


def test_run_environment_puts_the_bootstrap_first_once():
    env = run_environment({"PYTHONPATH": f"/a:{BOOTSTRAP_DIR}"}, fixes=FIX)
    assert env["PYTHONPATH"] == f"{BOOTSTRAP_DIR}:/a" and env["ZEROFIX"] == FIX
    # Launchers forward PYTHON* variables to every rank and node: activation rides on PYTHONPATH.
    assert BOOTSTRAP_DIR.endswith("zerofix/_bootstrap")


def test_status_cli_json():
    import json

    proc = subprocess.run([sys.executable, "-m", "zerofix", "status", "--json"], capture_output=True, text=True,
                          check=True)
    records = json.loads(proc.stdout)
    assert [r["id"] for r in records] == list(catalogue.ids())
    assert {"id", "state", "dist", "installed", "affected", "reason"} <= set(records[0])


def zerofix_cli(*argv, env=None):
    return subprocess.run([sys.executable, "-m", "zerofix", *argv], capture_output=True, text=True,
                          env={**os.environ, **(env or {})})


def test_zerofix_without_a_command_shows_the_commands_and_where_to_start():
    proc = zerofix_cli()
    assert proc.returncode == 2
    assert "{status,check,run,catalogue}" in proc.stderr and "zerofix status" in proc.stderr
    assert "required: cmd" not in proc.stderr


def test_an_unknown_option_is_reported_by_its_subcommand():
    proc = zerofix_cli("status", "--bogus")
    assert proc.returncode == 2
    # one line, by the subcommand, pointing at its --help (no usage block burying it)
    assert proc.stderr.startswith("zerofix status: error: unrecognized arguments: --bogus") and \
        proc.stderr.count("\n") == 1, proc.stderr


@pytest.mark.parametrize("flag", ["--fixes", "--disable"])
def test_zerofix_run_blames_the_flag_not_the_environment(flag):
    proc = zerofix_cli("run", flag, "nope", "--", sys.executable, "-c", "pass")
    assert proc.returncode == 2
    assert f"{flag} 'nope'" in proc.stderr and "ZEROFIX=" not in proc.stderr and \
        proc.stderr.startswith("zerofix run: error:")


def test_help_is_plain_text_and_dir_lists_the_public_names():
    for argv in ((), ("check",), ("status",), ("run",), ("catalogue",)):
        out = zerofix_cli(*argv, "--help").stdout
        assert out.startswith("usage: zerofix") and "``" not in out, argv
    import zerofix

    assert dir(zerofix) == sorted(zerofix.__all__) and "annotations" not in dir(zerofix)


def test_status_ends_with_the_answer_to_do_i_need_zerofix_here():
    from zerofix.cli import verdict_line
    from zerofix.patching import Record

    def record(fix_id, state):
        return Record(fix_id, state, "lib", "1.0", ">=1", "why")

    assert verdict_line([record("a", "not-affected"), record("b", "not-installed")]).startswith(
        "You do not need zerofix here")
    line = verdict_line([record("a", "inactive"), record("b", "applied"), record("c", "target-changed"),
                         record("d", "not-affected")])
    assert line.startswith("3 known bug(s)") and "Fixed now: b" in line and "not enabled: a (enable with ZEROFIX=1" in line
    assert "the code changed shape: c" in line and " d" not in line
    short = "accelerate-short-last-window"  # opt-in: named apart, before and after patch(), and counted
    for state in ("inactive", "disabled"):
        line = verdict_line([record("a", "inactive"), Record(short, state, "accelerate", "1.15.0", ">=1.1.1", "why")])
        assert line.startswith("2 known bug(s)") and f"opt-in, applied only when named, because a right usage " \
            f"looks the same: {short}" in line and "Not enabled: a (" in line, line
    out = zerofix_cli("status").stdout.strip().splitlines()
    assert out[-1].startswith("You do not need zerofix here") or "known bug(s) of the installed releases" in out[-1]


OPT_IN = "accelerate-short-last-window"


def test_opt_in_entries_apply_only_when_named():
    """ZEROFIX=1 / patch() enable every default entry; an opt-in entry (a right usage looks like its bug) only
    when named: ZEROFIX_OPT_IN, patch(opt_in=...), or an explicit list. status() says how to enable it."""
    from zerofix import catalogue

    assert OPT_IN in catalogue.ids() and OPT_IN not in catalogue.default_ids()
    assert read_environment({"ZEROFIX": "1", "ZEROFIX_OPT_IN": f" {OPT_IN} "}).opt_in == (OPT_IN,)
    with pytest.raises(ConfigError, match="ZEROFIX_OPT_IN"):
        read_environment({"ZEROFIX": "1", "ZEROFIX_OPT_IN": "nope"})
    proc = run_python("""
        import zerofix, zerofix.activation as a, zerofix.patching as p
        a.autopatch()
        print("default", ID in p._enabled)
        record = next(r for r in zerofix.status() if r.id == ID)
        print("state", record.state, "ZEROFIX_OPT_IN=" + ID in record.reason)
        zerofix.unpatch()
        zerofix.patch(opt_in=[ID])
        print("named", ID in p._enabled)
        zerofix.unpatch()
        zerofix.patch(fixes=[ID])
        print("listed", sorted(p._enabled) == [ID])
    """.replace("ID", repr(OPT_IN)), env={"ZEROFIX": "1"})
    assert proc.stdout.split("\n")[-5:-1] == ["default False", "state disabled True", "named True", "listed True"], \
        proc.stdout + proc.stderr
    proc = run_python("""
        import zerofix.activation as a, zerofix.patching as p
        a.autopatch()
        print(ID in p._enabled)
    """.replace("ID", repr(OPT_IN)), env={"ZEROFIX": "1", "ZEROFIX_OPT_IN": OPT_IN})
    assert proc.stdout.strip().endswith("True"), proc.stdout + proc.stderr


def test_a_misspelt_variable_is_named_not_ignored():
    """ZEROFIX_FIXES is not a variable: with ZEROFIX=1 the fixes apply and the warning names the real ones; alone,
    nothing is patched and the warning still comes (the .pth runs zerofix when any ZEROFIX_ variable is set)."""
    settings = read_environment({"ZEROFIX": "1", "ZEROFIX_FIXES": "x"})
    assert settings.enabled and any("ZEROFIX_FIXES is not a zerofix variable" in w and "ZEROFIX_DISABLE" in w
                                    for w in settings.warnings), settings.warnings
    assert read_environment({"ZEROFIX": "yes"}).enabled and not read_environment({"ZEROFIX": "no"}).enabled
    proc = subprocess.run([sys.executable, "-c", "import zerofix.activation as a; print(a.autopatch())"],
                          capture_output=True, text=True, env={**os.environ, "ZEROFIX_FIXES": "x", "ZEROFIX": "0"})
    assert proc.stdout.strip() == "None" and "ZEROFIX_FIXES is not a zerofix variable" in proc.stderr, proc.stderr


def test_a_folder_named_zerofix_beside_a_script_does_not_shadow_the_package(tmp_path):
    """The clone itself is such a folder when a script runs from the directory that holds it: with setuptools'
    default editable finder `import zerofix` found that folder as an empty namespace package (no `patch`)."""
    (tmp_path / "zerofix").mkdir()
    (tmp_path / "train.py").write_text("import zerofix\nprint(callable(zerofix.patch), zerofix.__file__)\n")
    proc = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, capture_output=True, text=True,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert proc.returncode == 0 and proc.stdout.startswith("True"), proc.stderr[-2000:]


def test_cli_version_and_a_reader_that_stops_early():
    """Issue 42: `zerofix status --json | head` and `check --list | head` printed a BrokenPipeError traceback; no
    --version existed."""
    zerofix = [sys.executable, "-m", "zerofix"]
    assert subprocess.run([*zerofix, "--version"], capture_output=True, text=True).stdout.startswith("zerofix ")
    for argv in (["status", "--json"], ["check", "--list"]):
        proc = subprocess.run(" ".join([*zerofix, *argv]) + " | head -c 1", shell=True, capture_output=True,
                              text=True, executable="/bin/bash")
        assert "BrokenPipeError" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_status_reads_one_fix_a_line():
    """Issue 42: zerofix.status() printed as one 4 KB line."""
    import zerofix

    records = zerofix.status()
    lines = repr(records).splitlines()
    assert len(lines) == len(records) and all(len(line) < 120 for line in lines)
    assert lines[0].startswith(records[0].id + ": ") and isinstance(records, list)


@pytest.mark.slow
@pytest.mark.stack("2026-04")
def test_status_apply_imports_only_the_targets_of_fixes_in_range():
    """Issue 42: on trl 1.5.1 `zerofix status --apply` tried trl.trainer.distillation_trainer (1.10 - 1.14's)."""
    proc = subprocess.run([sys.executable, "-m", "zerofix", "status", "--apply"], capture_output=True, text=True,
                          env={**os.environ, "DS_ACCELERATOR": "cpu"}, timeout=300)
    assert proc.returncode == 0 and "could not import" not in proc.stderr, proc.stderr[-2000:]


@pytest.mark.stack("latest")
def test_list_says_which_rows_a_run_would_skip(capsys):
    """Issue 42: --list listed rows a run skips without saying so (--fp16 on CPU; here trl 1.16's distillation)."""
    from zerofix import cli

    assert cli.main(["check", "--list", "--only", "trl-distill-uneven-chunks,trainer-1proc-moe"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "[skipped: trl 1.16.0 has no chunked divergence loop" in out[1] and "[skipped" not in out[0], out


@pytest.mark.stack("2026-04")
def test_the_readmes_status_example_is_what_the_tool_prints():
    """Issue 42: the README's `zerofix status` answer for 2026-04 listed 8 bugs where the tool printed 10."""
    proc = subprocess.run([sys.executable, "-m", "zerofix", "status"], capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if not k.startswith(("ZEROFIX", "_ZEROFIX"))})
    answer = proc.stdout.strip().splitlines()[-1]
    assert answer in (ROOT / "README.md").read_text(), answer


def test_a_long_reason_wraps_under_its_column():
    """Issue 42: `zerofix status` printed a 430-character reason cell on one line; it wraps under its column now."""
    from types import SimpleNamespace

    from zerofix import cli

    records = [SimpleNamespace(id="accelerate-short-last-window", state="inactive", dist="accelerate",
                               installed="1.13.0", affected=">=1.1.1", reason="word " * 86),
               SimpleNamespace(id="x", state="applied", dist="deepspeed", installed=None, affected="<1", reason="ok")]
    lines = cli.status_table(records, width=120)
    indent = lines[0].index("reason")
    assert all(len(line) <= 120 for line in lines), lines
    assert len(lines) > 3 and all(line[:indent].strip() == "" for line in lines[2:-1]), lines
    assert " ".join(line[indent:].strip() for line in lines[1:-1]) == ("word " * 86).strip()
    assert lines[-1].startswith("x ") and lines[-1].endswith("  ok")


def test_the_loss_statement_from_the_environment():
    """Issue 51: zerofix.loss_is_scaled_for_ga's statement for a framework's command line."""
    from zerofix.envvalues import loss_statement

    assert [loss_statement({"ZEROFIX_LOSS_IS_SCALED_FOR_GA": v}) for v in ("1", "true", "0", "no", "", "x")] == \
        [True, True, False, False, None, None]
    assert loss_statement({}) is None
