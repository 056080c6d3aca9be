"""The deployment files agree with each other and with the server, checked statically (no Docker
engine needed): the lock file is what the Makefile (so CI) and the Dockerfile install from, the
stop grace outlasts the server's drain, and the health check probes /health."""

from __future__ import annotations

import re
import shlex
from importlib import metadata
from pathlib import Path

import pytest
import yaml

from server.__main__ import build_parser

ROOT = Path(__file__).resolve().parents[2]
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#]+)$")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = PIN.match(line)
        assert match, f"constraints.txt: not an exact pin: {line!r}"
        assert canonical(match[1]) not in pins, f"constraints.txt pins {match[1]} twice"
        pins[canonical(match[1])] = match[2]
    return pins


def project_requirements() -> set[str]:
    """pagedserve's own requirements and its extras', by name (torch left out: pinned apart)."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    return {canonical(re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", r)[0]) for r in requirements} - {"torch"}


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    instructions, current = [], ""
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        current += line.rstrip().removesuffix("\\") + " "
        if not line.rstrip().endswith("\\"):
            keyword, _, rest = current.strip().partition(" ")
            instructions.append((keyword.upper(), rest.strip()))
            current = ""
    return instructions


def pip_installs(command: str) -> list[list[str]]:
    """The argument lists of every `pip install` in a shell command (split at &&, || and ;, with
    `{ ...; }` groups opened)."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    installs, words = [], []
    for token in [*lexer, ";"]:
        if token in ("&&", "||", ";", "|"):
            if words[:2] == ["pip", "install"]:
                installs.append(words[2:])
            words = []
        elif token not in ("{", "}"):
            words.append(token)
    return installs


def duration_seconds(text: str) -> float:
    parts = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+(?:\.\d+)?)s)?", str(text).strip())
    assert parts and any(parts.groups()), f"not a compose duration: {text!r}"
    h, m, s = parts.groups()
    return int(h or 0) * 3600 + int(m or 0) * 60 + float(s or 0)


def compose_service() -> dict:
    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    assert list(services) == ["pagedserve"]
    return services["pagedserve"]


def server_shutdown_timeout() -> float:
    return build_parser().get_default("shutdown_timeout")


def documented_stop_timeouts() -> set[int]:
    return {int(n) for n in re.findall(r"--stop-timeout[ =](\d+)", (ROOT / "Dockerfile").read_text())}


# ------------------------------------------------------------------ the lock file


def test_the_lock_file_pins_every_dependency_but_torch():
    pins = lock_pins()
    assert not [name for name in pins if name in ("torch", "triton", "pagedserve") or name.startswith("nvidia-")]
    wanted = project_requirements()
    assert wanted and wanted <= set(pins), f"not in constraints.txt: {sorted(wanted - set(pins))}"


def test_the_makefile_installs_through_the_lock_file():
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^CONSTRAINTS\s*:=\s*constraints\.txt\s*$", makefile, re.M)
    installs = [line for line in makefile.splitlines() if re.search(r"pip install", line)]
    package_installs = [line for line in installs if "--upgrade pip" not in line]
    assert package_installs, "the Makefile installs nothing?"
    for line in package_installs:
        assert "-c $(CONSTRAINTS)" in line, f"Makefile installs without the lock file: {line.strip()}"
    assert re.search(r"^\$\(VENV\)/\.installed:.*\$\(CONSTRAINTS\)", makefile, re.M), (
        "a changed lock file must re-run the install"
    )
    assert re.search(r"^lock:", makefile, re.M), "`make lock` updates the lock file on purpose"
    assert (ROOT / ".ci" / "run").read_text().strip().endswith("make test")  # so CI installs it too


def test_the_dockerfile_installs_through_the_lock_file_and_the_makefiles_torch():
    instructions = dockerfile_instructions()
    copies = [args for keyword, args in instructions if keyword == "COPY"]
    assert any("constraints.txt" in args.split() for args in copies), "the lock file is not copied into the image"
    installs = [words for keyword, args in instructions if keyword == "RUN" for words in pip_installs(args)]
    from_index = [words for words in installs if "${TORCH_SPEC}" in words and "--index-url" in words]
    assert len(from_index) == 1 and "--no-deps" in from_index[0], (
        "torch comes alone from its index; its dependencies come pinned with the rest"
    )
    assert from_index[0][from_index[0].index("--index-url") + 1] == "${TORCH_INDEX}"
    rest = [words for words in installs if words not in from_index and words != ["--upgrade", "pip"]]
    assert rest
    for words in rest:  # the fallback for an unreachable TORCH_INDEX among them
        assert "-c" in words and words[words.index("-c") + 1] == "constraints.txt", f"unlocked: pip install {words}"
    torch_spec = re.search(r"^ARG TORCH_SPEC=(\S+)$", (ROOT / "Dockerfile").read_text(), re.M)[1]
    torch_pin = re.search(r"^TORCH_PIN\s*:=\s*(\S+)$", (ROOT / "Makefile").read_text(), re.M)[1]
    assert torch_spec == torch_pin


def test_the_dockerfile_falls_back_as_the_makefile_does_when_the_torch_index_is_unreachable():
    torch_runs = [
        args
        for keyword, args in dockerfile_instructions()
        if keyword == "RUN" and "--index-url" in args and "${TORCH_SPEC}" in args
    ]
    assert len(torch_runs) == 1
    fallback = torch_runs[0].split("--index-url", 1)[1].partition("||")[2]
    assert [words for words in pip_installs(fallback) if "${TORCH_SPEC}" in words] == [
        ["-c", "constraints.txt", "${TORCH_SPEC}"]
    ]
    assert re.search(r"--index-url \$\(TORCH_INDEX\)[^\n]*\\\n\s*\|\|", (ROOT / "Makefile").read_text())


def test_the_dockerfile_builds_pagedserve_with_the_locked_setuptools():
    # An isolated build would install the newest setuptools, out of the lock file's reach.
    installs = [
        words for keyword, args in dockerfile_instructions() if keyword == "RUN" for words in pip_installs(args)
    ]
    project = [words for words in installs if words[-1] == "."]
    assert len(project) == 1 and "--no-build-isolation" in project[0]
    setuptools = installs.index(next(words for words in installs if "setuptools" in words))
    assert setuptools < installs.index(project[0]) and "constraints.txt" in installs[setuptools]
    assert "setuptools" in lock_pins()


def test_this_environment_holds_the_locked_versions():
    # CI's fresh venv is installed through the lock file; a venv upgraded on purpose needs `make lock`.
    pins = lock_pins()
    drift = {}
    for name in project_requirements():
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        if installed != pins[name]:
            drift[name] = (installed, pins[name])
    assert not drift, f"installed vs constraints.txt (run `make lock` if this was on purpose): {drift}"


# ------------------------------------------------------------------ stopping


def test_the_stop_grace_outlasts_the_servers_drain_everywhere():
    drain = server_shutdown_timeout()
    grace = duration_seconds(compose_service()["stop_grace_period"])
    assert grace > drain + 5, f"compose stop_grace_period {grace}s leaves no time after a {drain}s drain"
    documented = documented_stop_timeouts()
    assert documented == {int(grace)}, f"Dockerfile documents --stop-timeout {documented}, compose {grace}s"
    text = (ROOT / "Dockerfile").read_text()
    assert (
        f"--shutdown-timeout ({drain:g} s" in text
        or f"--shutdown-timeout ({drain:g}" in text
        or f"--shutdown-timeout {drain:g}" in text
        or f"({drain:g} s)" in text
    )
    stop = [args for keyword, args in dockerfile_instructions() if keyword == "STOPSIGNAL"]
    assert stop == ["SIGTERM"] and compose_service().get("stop_signal", "SIGTERM") == "SIGTERM"


def test_the_readme_gives_the_same_numbers():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Docker", 1)
    assert len(section) == 2, "README has a Docker section"
    docker = section[1].split("\n## ", 1)[0]
    assert f"--stop-timeout {int(duration_seconds(compose_service()['stop_grace_period']))}" in docker
    assert f"stop_grace_period: {compose_service()['stop_grace_period']}" in docker
    assert f"{server_shutdown_timeout():g} s" in docker
    assert "--read-only" in docker and "/tmp" in docker


def test_the_image_carries_a_kernel_build_for_every_cpu():
    """The build stage builds every ISA target of the CPU kernels into the extensions directory
    that the runtime stage copies and reads, so a CPU unlike the build machine's finds its own."""
    stages: list[list[tuple[str, str]]] = []
    for keyword, args in dockerfile_instructions():
        if keyword == "FROM":
            stages.append([])
        elif stages:
            stages[-1].append((keyword, args))
    build, runtime = stages

    def extensions_dir(stage):
        found = [
            m[1]
            for keyword, args in stage
            if keyword == "ENV"
            for m in [re.search(r"TORCH_EXTENSIONS_DIR=(\S+)", args)]
            if m
        ]
        assert len(found) == 1, "TORCH_EXTENSIONS_DIR set once per stage"
        return found[0]

    assert extensions_dir(build) == extensions_dir(runtime)
    assert any("python -m models.layers.cpu_kernels --build-all" in args for keyword, args in build if keyword == "RUN")
    copied = [shlex.split(args)[-2:] for keyword, args in runtime if keyword == "COPY" and "--from=build" in args]
    assert any(src == dst and Path(extensions_dir(runtime)).is_relative_to(dst) for src, dst in copied)


# ------------------------------------------------------------------ compose


def test_compose_checks_health_on_the_served_port():
    service = compose_service()
    check = service["healthcheck"]["test"]
    command = " ".join(check) if isinstance(check, list) else check
    assert "http://127.0.0.1:8000/health" in command
    dockerfile_check = [args for keyword, args in dockerfile_instructions() if keyword == "HEALTHCHECK"]
    assert len(dockerfile_check) == 1 and "http://127.0.0.1:8000/health" in dockerfile_check[0]
    assert duration_seconds(service["healthcheck"]["start_period"]) >= 60  # the model loads first
    assert any(str(port).endswith(":8000") for port in service["ports"])
    entrypoint = [args for keyword, args in dockerfile_instructions() if keyword == "ENTRYPOINT"]
    assert entrypoint and '"--port", "8000"' in entrypoint[0]


def test_compose_takes_the_api_key_from_the_environment_and_mounts_checkpoints():
    service = compose_service()
    env = service["environment"]
    assert re.fullmatch(r"\$\{PAGEDSERVE_API_KEY(:?-[^}]*)?\}", env["PAGEDSERVE_API_KEY"])
    from server.__main__ import API_KEY_ENV

    assert API_KEY_ENV == "PAGEDSERVE_API_KEY"
    assert any(str(volume).split(":")[-2:] == ["/checkpoints", "ro"] for volume in service["volumes"])
    assert service["build"] == "." and (ROOT / "compose.yaml").parent == (ROOT / "Dockerfile").parent


def test_compose_publishes_on_loopback_unless_told_otherwise():
    """No API key by default, so the port is the host's loopback unless PAGEDSERVE_BIND says otherwise."""
    ports = compose_service()["ports"]
    assert ports and all(re.fullmatch(r"\$\{PAGEDSERVE_BIND:-127\.0\.0\.1\}:.+:8000", str(p)) for p in ports), ports


def test_compose_runs_read_only_with_a_writable_tmp():
    service = compose_service()
    assert service["read_only"] is True
    assert "/tmp" in service["tmpfs"]


@pytest.mark.parametrize("text,seconds", [("45s", 45), ("1m30s", 90), ("2m", 120)])
def test_duration_parsing(text, seconds):
    assert duration_seconds(text) == seconds
