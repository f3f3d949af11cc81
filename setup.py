"""Packaging for charm-megatron: CHARM+ context-parallel attention for Megatron-LM."""

from setuptools import find_packages, setup

setup(
    name="charm-megatron",
    version="0.1.0",
    description="CHARM+ cross-hardware context-parallel attention as a Megatron-LM backend",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["charm_megatron", "charm_megatron.*"]),
    package_data={"charm_megatron": ["configs/*.yaml", "devices/data/*.json",
                                    "devices/measurements/*.json", "devices/measurements/*.tsv"]},
    # torch: lower bound only; CI pins the CPU build torch==2.13.0 in the Makefile.
    install_requires=["torch>=2.3", "numpy", "pyyaml", "pydantic>=2"],
    extras_require={
        # Tested with megatron-core 0.16.1 (the newest release for Python 3.11).
        "megatron": ["megatron-core>=0.16"],
        # Imported lazily, never at module import; apex is part of the user's Megatron
        # environment (NVIDIA's apex is not on the package index) and is not listed here.
        "gpu": ["flash-attn", "transformer-engine[pytorch]"],
        # pytest-xdist: `make test` runs two workers (the suite waits on timeouts and on
        # single-process plan checks that the other core can serve meanwhile).
        # triton: its interpreter runs the CUDA merge kernel (kernels/merge_fused.py) on CPU in
        # the tests; the package imports it only for CUDA tensors.
        "dev": ["pytest>=7", "pytest-xdist>=3", "hypothesis>=6", "ruff>=0.4", "matplotlib",
                "triton"],
    },
    entry_points={"console_scripts": ["charm-megatron=charm_megatron.cli:main"]},
)
