"""Install Tandem. ``TANDEM_MYPYC=1`` compiles the hot control-plane modules listed in MYPYC_MODULES with mypyc.

The package works compiled and interpreted: without TANDEM_MYPYC the modules stay plain Python.
"""

import os
import re
import shutil
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
VERSION = re.search(r'^__version__ = "([^"]+)"', (HERE / "tandem" / "__init__.py").read_text(), re.M).group(1)  # type: ignore[union-attr]
KERNEL_DIR = "tandem/backend/cuda/src"  # where a wheel carries cuda/*.cu and *.cuh (the loader's second place)


class BuildPyWithKernels(build_py):
    """build_py that also copies the kernel sources cuda/*.cu and cuda/*.cuh into the built package, so a
    non-editable install can compile them (tandem/backend/cuda/loader.py looks in the repository first)."""

    def run(self) -> None:
        super().run()
        dst = Path(self.build_lib) / KERNEL_DIR
        dst.mkdir(parents=True, exist_ok=True)
        for src in sorted((HERE / "cuda").glob("*.cu*")):
            if src.suffix in (".cu", ".cuh"):
                shutil.copyfile(src, dst / src.name)


# The one place that lists the modules mypyc compiles (DESIGN.md: tree walk, acceptance, StairCut pricing,
# cache bookkeeping). Plain typed Python only: ints, lists, small classes.
MYPYC_MODULES = [
    "tandem/speculative/tree.py",
    "tandem/speculative/acceptance.py",
    "tandem/speculative/staircut.py",
    "tandem/speculative/lookup.py",
    "tandem/cache/index.py",
    "tandem/models/state.py",
    "tandem/config.py",
]

ext_modules = []
if os.environ.get("TANDEM_MYPYC", "") not in ("", "0"):
    from mypyc.build import mypycify

    ext_modules = mypycify(["--config-file", "mypy.ini", *MYPYC_MODULES], opt_level="3")

TEST_DEPS = [
    "pytest>=8",
    "pytest-xdist>=3.5",  # the compiled-build pass runs on every core (tools/test.sh)
    "mypy>=1.10",
    "torch==2.13.0",  # the CPU build; used by parity tests against transformers only
    "transformers>=5.2",
    "openai>=1.40",
    "anthropic>=0.40",
    "httpx",
    "ml_dtypes>=0.4",  # cross-checks of tandem/dtypes.py; the package itself converts in NumPy
    "safetensors>=0.4",  # tools/train_default_model.py; tandem/checkpoint.py reads the format itself
    "jsonschema>=4",
    "hypothesis>=6.100",  # the server fuzz test (derandomized, small budget)
    "websockets>=13",  # the Responses API's WebSocket mode as a client sees it
    "selenium>=4.20",  # the dashboard driven in headless Chromium (Debian chromium + chromium-driver)
    "pillow>=10",  # images in (tests/test_vision.py)
]

setup(
    name="tandem",
    version=VERSION,
    description="Speculative inference engine for the Qwen3.5 hybrid Gated-DeltaNet/attention models",
    python_requires=">=3.11",
    packages=find_packages(include=["tandem", "tandem.*"]),
    package_data={"tandem": ["assets/default/*", "server/dashboard/*"]},
    include_package_data=True,
    ext_modules=ext_modules,
    cmdclass={"build_py": BuildPyWithKernels},
    install_requires=[
        "numpy>=1.26",
        "tokenizers>=0.19",
        "jinja2>=3.1",
        "tqdm>=4.60",
        "orjson>=3.9",
        "starlette>=0.37",
        "hypercorn>=0.16",
        "prometheus-client>=0.20",
        "llguidance>=1.9",  # LLTokenizer(eos_token=[ids]): a list of stop ids
    ],
    extras_require={
        "test": TEST_DEPS,
        "cuda12": ["cupy-cuda12x>=13"],
        "cuda13": ["cupy-cuda13x>=13"],
        "mypyc": ["mypy>=1.10", "setuptools>=68"],
        # images in: tandem/images.py decodes with Pillow (imported when an image arrives); httpx fetches image URLs
        # under --allow-image-urls (tandem/image_fetch.py, imported at the first fetch)
        "vision": ["pillow>=10", "httpx>=0.27"],
    },
    entry_points={"console_scripts": ["tandem=tandem.cli:main"]},
)
