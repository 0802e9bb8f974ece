"""Hatchling build hook: compiles the zero_ops._C extension (C++17, pybind11) at install time.

Runs for wheels and editable installs (``pip install packages/zero-ops``, ``pip install -e``,
sdist -> wheel). No CUDA, no torch headers: the extension takes raw pointers from the Python
layer, so it builds in a few seconds with only a C++ compiler and pybind11.

See [Note: runtime ISA dispatch] in csrc/bindings.cpp for why the optimizer kernels are compiled
several times with different ``-m`` flags instead of once with ``-march=native``.

Environment knobs:
  CXX                  compiler (default ``c++``)
  ZERO_OPS_CXXFLAGS    extra flags appended to every compile (e.g. ``-march=native`` locally)
  ZERO_OPS_NO_OPENMP=1 build without OpenMP (single-threaded kernels)
  ZERO_OPS_NO_LIBAIO=1 build without libaio even when <libaio.h> is present (async I/O then
                       uses its thread-pool backend only)
"""

from __future__ import annotations

import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

# -fno-math-errno lets sqrt vectorise; -ffp-contract=off: fused multiply-adds only where the
# kernels ask for them (see [Note: matching torch's rounding] in csrc/optim_kernels.cpp).
COMMON_FLAGS = ["-std=c++17", "-O3", "-fPIC", "-fvisibility=hidden", "-fno-math-errno", "-ffp-contract=off"]
X86_VARIANTS = {
    "generic": [],
    "avx2": ["-mavx2", "-mfma", "-mf16c", "-DZERO_OPS_USE_FMA"],
    "avx512": [
        "-mavx512f",
        "-mavx512bw",
        "-mavx512vl",
        "-mavx512dq",
        "-mavx2",
        "-mfma",
        "-mf16c",
        "-mprefer-vector-width=512",
        "-DZERO_OPS_USE_FMA",
    ],
}


def _is_x86_64() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def _compiler_accepts(cxx: str, flags: list[str]) -> bool:
    """Whether ``cxx`` compiles and links a trivial OpenMP-using program with ``flags``."""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "probe.cpp")
        with open(src, "w") as f:
            f.write(
                "int main() { int s = 0;\n#pragma omp parallel for reduction(+:s)\n"
                "for (int i = 0; i < 4; ++i) s += i; return s == 6 ? 0 : 1; }\n"
            )
        proc = subprocess.run([cxx, *flags, src, "-o", os.path.join(tmp, "probe")], capture_output=True)
        return proc.returncode == 0


def _libaio_available(cxx: str) -> bool:
    """Whether <libaio.h> compiles and -laio links (Debian/Ubuntu: libaio-dev; Fedora: libaio-devel)."""
    if platform.system() != "Linux" or os.environ.get("ZERO_OPS_NO_LIBAIO") == "1":
        return False
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "probe_aio.cpp")
        with open(src, "w") as f:
            f.write(
                "#include <libaio.h>\nint main() { io_context_t c = 0; "
                "return io_setup(1, &c) == 0 ? io_destroy(c) : 0; }\n"
            )
        proc = subprocess.run([cxx, src, "-o", os.path.join(tmp, "probe_aio"), "-laio"], capture_output=True)
        return proc.returncode == 0


def build_key(root: str) -> str:
    """What an editable build's library depends on: every source under csrc/, this hook, the
    compiler (its ``--version``), the knobs above, pybind11 and the interpreter's ABI.

    [Note: editable builds reuse the in-tree library]
    An editable install compiles into ``src/zero_ops/`` of the checkout, so every environment
    that installs zero-ops editable from one checkout (``hatch test --all`` makes four: zero-ops,
    zero-offload, zero-inference, zero) writes the same file. The key of what it was built from
    is stored next to it (``_C<suffix>.key``); an editable build whose key matches keeps that
    library instead of compiling it again. Anything that changes the result (a source, a flag,
    the compiler, the Python ABI) changes the key. Wheels are always compiled afresh.
    """
    import pybind11

    cxx = os.environ.get("CXX", "c++")
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    except OSError:
        version = "missing"
    digest = hashlib.sha256()
    for part in (
        cxx,
        version,
        platform.machine(),
        pybind11.__version__,
        sysconfig.get_config_var("EXT_SUFFIX") or "",
        sysconfig.get_paths()["include"],
        *(
            f"{k}={os.environ.get(k, '')}"
            for k in ("ZERO_OPS_CXXFLAGS", "ZERO_OPS_NO_OPENMP", "ZERO_OPS_NO_LIBAIO")
        ),
    ):
        digest.update(part.encode() + b"\0")
    csrc = os.path.join(root, "csrc")
    for name in sorted(os.listdir(csrc)):
        with open(os.path.join(csrc, name), "rb") as f:
            digest.update(name.encode() + b"\0" + f.read() + b"\0")
    with open(__file__, "rb") as f:
        digest.update(f.read())
    return digest.hexdigest()


def build_extension(root: str, out_path: str) -> None:
    """Compiles csrc/ into the shared library ``out_path``."""
    import pybind11

    cxx = os.environ.get("CXX", "c++")
    extra = shlex.split(os.environ.get("ZERO_OPS_CXXFLAGS", ""))
    csrc = os.path.join(root, "csrc")
    openmp = os.environ.get("ZERO_OPS_NO_OPENMP") != "1" and _compiler_accepts(cxx, ["-fopenmp"])
    omp = ["-fopenmp"] if openmp else []
    includes = ["-I", csrc, "-I", pybind11.get_include(), "-I", sysconfig.get_paths()["include"]]
    variants = X86_VARIANTS if _is_x86_64() else {"generic": []}
    # Kernel AIO for the async I/O engine when present; the thread pool otherwise (see
    # [Note: aio backends] in csrc/aio_engine.h).
    libaio = _libaio_available(cxx)
    aio_def = ["-DZERO_OPS_HAVE_LIBAIO"] if libaio else []
    aio_lib = ["-laio"] if libaio else []

    with tempfile.TemporaryDirectory() as objdir:
        jobs: list[tuple[list[str], str]] = []
        for name, isa_flags in variants.items():
            obj = os.path.join(objdir, f"optim_{name}.o")
            cmd = [cxx, *COMMON_FLAGS, *omp, *isa_flags, f"-DZERO_OPS_ISA_NS={name}", *includes, *extra]
            jobs.append(([*cmd, "-c", os.path.join(csrc, "optim_kernels.cpp"), "-o", obj], obj))
        for src in ("aio_engine.cpp", "aio_libaio.cpp", "bindings.cpp"):
            obj = os.path.join(objdir, src.replace(".cpp", ".o"))
            cmd = [
                cxx,
                *COMMON_FLAGS,
                *omp,
                *aio_def,
                *includes,
                *extra,
                "-c",
                os.path.join(csrc, src),
                "-o",
                obj,
            ]
            jobs.append((cmd, obj))

        def run(cmd: list[str]) -> None:
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(
                    f"zero-ops: compile failed:\n{shlex.join(cmd)}\n{proc.stdout}{proc.stderr}"
                )

        with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
            list(pool.map(run, [cmd for cmd, _ in jobs]))
        tmp_out = out_path + ".tmp"
        run([cxx, "-shared", *omp, *[obj for _, obj in jobs], "-o", tmp_out, *aio_lib, "-lpthread"])
        os.replace(tmp_out, out_path)  # atomic: a running interpreter never sees half a library


def _holds(path: str, text: str) -> bool:
    try:
        with open(path) as f:
            return f.read() == text
    except OSError:
        return False


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


class CustomBuildHook(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict) -> None:
        if self.target_name != "wheel":
            return  # the sdist ships csrc/ and this hook; its wheel build compiles
        ext = sysconfig.get_config_var("EXT_SUFFIX")
        if version == "editable":
            # In-tree, next to the sources the editable .pth points at.
            # See [Note: editable builds reuse the in-tree library]
            out = os.path.join(self.root, "src", "zero_ops", f"_C{ext}")
            key, key_path = build_key(self.root), out + ".key"
            if not (_holds(key_path, key) and os.path.exists(out)):
                if os.path.exists(key_path):
                    os.unlink(key_path)  # no stale key for a library a failed build replaced
                build_extension(self.root, out)
                _write_atomic(key_path, key)
        else:
            # Built fresh for every wheel (never reuse an in-tree library built with other flags).
            self._tmpdir = tempfile.mkdtemp(prefix="zero_ops_build_")
            out = os.path.join(self._tmpdir, f"_C{ext}")
            build_data["force_include"][out] = f"zero_ops/_C{ext}"
            build_extension(self.root, out)
        build_data["pure_python"] = False
        build_data["infer_tag"] = True

    def finalize(self, version: str, build_data: dict, artifact_path: str) -> None:
        tmpdir = getattr(self, "_tmpdir", None)
        if tmpdir is not None:
            shutil.rmtree(tmpdir, ignore_errors=True)
