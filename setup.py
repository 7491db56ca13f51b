"""Builds torch_xla_ext and its C++ core against the lazy-tensor headers in torch.

Build without isolation so the installed torch is used rather than a second
download: pip install --no-build-isolation -e .
"""
from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

setup(
    name="torch_xla_ext",
    version="0.1.0",
    description="Placeholder tensors, a cached scan and zero-copy layer stacks for PyTorch/XLA",
    packages=find_packages(include=["torch_xla_ext", "torch_xla_ext.*"]),
    ext_modules=[
        CppExtension(
            "torch_xla_ext._C",
            ["csrc/placeholder_data.cc", "csrc/parameter_table.cc", "csrc/bindings.cpp"],
            extra_compile_args=["-O2", "-std=c++17"],
        )
    ],
    cmdclass={"build_ext": BuildExtension},
    python_requires=">=3.10",
    install_requires=["torch==2.9.0", "torch_xla==2.9.0", "numpy"],
)
