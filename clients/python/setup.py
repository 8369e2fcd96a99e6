"""Build hook of kerneleval-client: the package ships the code generated from ../../proto.

The generated modules (kerneleval.v1, kerneleval.internal) are not in git, so a wheel built from
a clone (`pip install clients/python`) makes them here: build_py runs protoc from grpcio-tools
(a build requirement) into the wheel's tree, and into src/ for an editable install, which uses
the source tree. An sdist carries them (made the same way), so a wheel built from the sdist,
where ../../proto is out of reach, needs no protoc. Everything else is in pyproject.toml.
"""

from __future__ import annotations

import shutil
from importlib import resources
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = Path(__file__).resolve().parent
PROTO_ROOT = HERE.parent.parent / "proto"
# Packages protoc writes (one folder per proto package), each given an __init__.py.
GENERATED_PACKAGES = ("kerneleval/v1", "kerneleval/internal", "kerneleval/internal/v1")
# Typed gRPC stubs (*_pb2_grpc.pyi), from mypy-protobuf (a build requirement).
MYPY_GRPC_PLUGIN = "protoc-gen-mypy_grpc"
# The Connect stubs (--http-port of the server) need their plugin, which needs Python 3.11.
CONNECT_PLUGIN = "protoc-gen-connectrpc"


def _protos() -> list[Path]:
    return sorted(PROTO_ROOT.glob("kerneleval/**/*.proto"))


def generate(out: Path) -> None:
    """Messages, .pyi stubs, gRPC stubs and, where their plugins are, typed gRPC stubs and
    Connect stubs into `out`."""
    from grpc_tools import protoc  # a build requirement: imported only when there are protos

    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{resources.files('grpc_tools') / '_proto'}",  # google/protobuf/*.proto
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
    ]
    mypy_grpc = shutil.which(MYPY_GRPC_PLUGIN)
    if mypy_grpc:
        args += [f"--plugin={MYPY_GRPC_PLUGIN}={mypy_grpc}", f"--mypy_grpc_out=quiet:{out}"]
    plugin = shutil.which(CONNECT_PLUGIN)
    if plugin:
        args += [
            f"--plugin={CONNECT_PLUGIN}={plugin}",
            f"--connectrpc_out={out}",
            "--connectrpc_opt=protobuf=google",
        ]
    protos = [str(p.relative_to(PROTO_ROOT)) for p in _protos()]
    if protoc.main(args + protos) != 0:
        raise SystemExit(f"protoc failed on {PROTO_ROOT} (see its messages above)")
    for package in GENERATED_PACKAGES:
        (out / package / "__init__.py").touch()


class BuildPyWithProtos(build_py):
    def run(self) -> None:
        super().run()
        if _protos():
            # An editable install imports from src/, a wheel from build_lib.
            generate(HERE / "src" if self.editable_mode else Path(self.build_lib))
        elif not any(
            (root / "kerneleval" / "v1" / "kernel_pb2.py").exists()
            for root in (Path(self.build_lib), HERE / "src")
        ):
            raise SystemExit(
                f"neither the protos ({PROTO_ROOT}) nor generated code (src/kerneleval/v1): "
                "build from a clone of the repository or from the sdist"
            )


class SdistWithProtos(sdist):
    def make_release_tree(self, base_dir: str, files: list[str]) -> None:
        super().make_release_tree(base_dir, files)
        if _protos():
            src = Path(base_dir) / "src"
            # The tree's files are hard links to the checkout's: replace, never write through.
            for package in ("kerneleval/v1", "kerneleval/internal"):
                shutil.rmtree(src / package, ignore_errors=True)
            generate(src)


setup(cmdclass={"build_py": BuildPyWithProtos, "sdist": SdistWithProtos})
