"""conf/ (the Hydra config groups) stays at the repository's top level, where operators and the design expect it,
and ships inside the wheel as the package data deltafin/conf, where an installed copy finds it
(deltafin/config/compose.py `conf_dir`). Everything else is in pyproject.toml."""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["deltafin*"]), "deltafin.conf"], package_dir={"deltafin.conf": "conf"})
