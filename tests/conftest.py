"""Shared pytest fixtures."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture(scope="session")
def sample_photos() -> list[np.ndarray]:
    """The two photographs bundled with scikit-learn (china.jpg, flower.jpg): uint8 `[427, 640, 3]`."""
    from sklearn.datasets import load_sample_images

    return list(load_sample_images().images)
