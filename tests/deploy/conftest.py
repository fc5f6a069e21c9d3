"""The rendered kustomizations, shared by the manifest and address checks (rendering all of them takes seconds)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.deploy.test_manifests import KUSTOMIZATIONS, ROOT, SECRET_FILES, render


@pytest.fixture(scope="session")
def secure_tree(tmp_path_factory) -> Path:
    """k8s/ copied with placeholder secret files, as scripts/make_secrets.sh --k8s would leave them."""
    dest = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(ROOT / "k8s", dest)
    for f in SECRET_FILES:
        (dest / "components" / "secure" / "secrets" / f).write_text(f"placeholder {f}\n")
    return dest


@pytest.fixture(scope="session")
def rendered(secure_tree) -> dict[str, list[dict]]:
    return {k: render((secure_tree if k.endswith("secure") else ROOT / "k8s") / k) for k in KUSTOMIZATIONS}
