# Maps the top-level folders models/ and kernels/ to titan_mok.models and
# titan_mok.kernels (docs/design.md §2), so nothing claims the global names.
from setuptools import find_packages, setup

MAPPED = {"models": "titan_mok.models", "kernels": "titan_mok.kernels"}
packages = find_packages(include=["titan_mok", "titan_mok.*"])
for folder, name in MAPPED.items():
    packages += [name + sub[len(folder):] for sub in find_packages(include=[folder, folder + ".*"])]

setup(
    packages=packages,
    package_dir={"titan_mok": "titan_mok", **{name: folder for folder, name in MAPPED.items()}},
)
