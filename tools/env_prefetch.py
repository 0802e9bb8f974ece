"""Create the later environments of ``hatch test --all`` while the first package's tests run.

[Note: a fresh hatch test --all in minutes]
A fresh ``hatch test --all`` makes eight environments and runs eight test suites, and hatch does
both strictly one after another: each environment is created only when the previous package's
tests have finished. Creating one is mostly waiting (the index's answers, unpacking, linking
from uv's cache) plus a compile of zero-ops, while tests are mostly computing, so the two overlap
well even on two cores. Three things make a fresh run short:

* the runner of the matrix's first package (tools/run_package_tests.py) starts this file in the
  background, which runs ``hatch env create`` for every later package of the matrix, in the
  matrix's order, with the hatch process's own command prefix, environment and directory. The
  runner of package N, once its tests are done, waits until package N+1's environment is
  ready (a marker file per environment), so hatch never starts creating an environment this
  file is still creating. A creation that fails is left for hatch to do again in its own turn,
  where its error is shown as usual; the runner prints the tail of this file's log for it.
* zero-ops compiles once per checkout, not once per environment (see [Note: editable builds
  reuse the in-tree library] in packages/zero-ops/hatch_build.py).
* each package's tests run on every core (pytest-xdist through hatch test's ``parallel``, whole
  files per worker; see hatch.toml).

The summary of ``hatch test --all`` prints each package's wall and CPU seconds, so the time a
quiet machine needs can be judged on a loaded one too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

POLL_S = 0.5
DONE = "prefetch.done"


def _marker(folder: Path, env_name: str) -> Path:
    return folder / f"{env_name}.created"


def start(folder: Path, hatch_pid: int, hatch_argv: list[str], env_names: list[str]) -> None:
    """Start creating ``env_names`` in the background, as the hatch process ``hatch_pid`` would.

    ``hatch_argv`` is that process's command line; everything before its ``test`` (interpreter,
    hatch, global options such as ``--data-dir``) prefixes ``env create``.
    """
    if not env_names or "test" not in hatch_argv:
        return
    prefix = hatch_argv[: hatch_argv.index("test")]
    try:
        raw = Path(f"/proc/{hatch_pid}/environ").read_bytes()
        cwd = os.readlink(f"/proc/{hatch_pid}/cwd")
    except OSError:
        return  # no /proc: hatch creates every environment itself, as it would without us
    env = dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)
    folder.mkdir(parents=True, exist_ok=True)
    args = [sys.executable, __file__, str(folder), str(hatch_pid), json.dumps(prefix), *env_names]
    with open(folder / "prefetch.log", "ab") as log:
        proc = subprocess.Popen(
            args, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True
        )
    (folder / "prefetch.pid").write_text(str(proc.pid))


def wait_for(folder: Path, env_name: str) -> str | None:
    """Block until the background creation of ``env_name`` ended (or never will); a message when
    it failed, None otherwise (also when no creation was started)."""
    marker = _marker(folder, env_name)
    started = time.monotonic()
    pid_file = folder / "prefetch.pid"
    while not marker.exists():
        if not pid_file.exists() or (folder / DONE).exists() or not _alive(int(pid_file.read_text())):
            return None  # nothing is creating it (any more): hatch will
        time.sleep(POLL_S)
    record = json.loads(marker.read_text())
    waited = time.monotonic() - started
    if waited >= 1:
        print(f"[waited {waited:.0f} s for the environment {env_name}, created in the background]")
    if record["exit"] == 0:
        return None
    log = (folder / f"{env_name}.log").read_text(errors="replace")[-3000:]
    return f"[creating {env_name} in the background failed; hatch creates it again next]\n{log}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def main(argv: list[str]) -> int:
    folder, hatch_pid, prefix, env_names = Path(argv[0]), int(argv[1]), json.loads(argv[2]), argv[3:]
    try:
        for name in env_names:
            if not _alive(hatch_pid):
                break  # hatch test --all was stopped: create nothing more
            began = time.monotonic()
            with open(folder / f"{name}.log", "wb") as log:
                code = subprocess.run([*prefix, "env", "create", name], stdout=log, stderr=log).returncode
            record = {"exit": code, "seconds": time.monotonic() - began}
            tmp = folder / f"{name}.tmp"
            tmp.write_text(json.dumps(record))
            tmp.replace(_marker(folder, name))  # atomic: a waiting runner never reads half of it
    finally:
        if folder.exists():
            (folder / DONE).touch()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
