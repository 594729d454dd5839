"""OFT's image pipeline, held to TensorFlow's own output.

``fixtures/oft_image_pipeline.npz`` was written by ``scripts/make_image_goldens.py`` with TensorFlow 2.21 (the
ops of openvla-oft's resize_image_for_policy and center_crop_image) from two 256 px LIBERO camera images
(libero_10 task 0, init state 0: agentview and wrist, rendered from LIBERO's original assets) and a synthetic image
with hard edges. embodirl runs the
same pipeline without TensorFlow; every stage must agree within one uint8 level.
"""

from pathlib import Path

import numpy as np
import pytest
import torch

from embodirl.models.processor import ImageProcessor, jpeg_round_trip, oft_resize

FIXTURE = Path(__file__).parent / "fixtures" / "oft_image_pipeline.npz"


@pytest.fixture(scope="module")
def golden():
    data = np.load(FIXTURE)
    return {k: data[k] for k in data.files}


def nchw(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(array).permute(0, 3, 1, 2)


def max_level_difference(ours: torch.Tensor, theirs: np.ndarray) -> int:
    return int((ours.float() - nchw(theirs).float()).abs().max())


def test_jpeg_round_trip_matches_tensorflow(golden):
    assert max_level_difference(jpeg_round_trip(nchw(golden["inputs"])), golden["jpeg"]) <= 1


def test_lanczos3_resize_matches_tensorflow(golden):
    ours = oft_resize(nchw(golden["inputs"]), 224)                                     # (N, 3, 224, 224)
    assert max_level_difference(ours, golden["resized"]) <= 1


def test_processor_levels_match_ofts_pipeline(golden):
    """The processor the policy runs: 256 px cameras in, OFT's resized and centre-cropped 224 px image out."""
    images = nchw(golden["inputs"])[None]                                            # (1, N, 3, 256, 256)
    assert max_level_difference(ImageProcessor(224).uint8_levels(images), golden["resized"]) <= 1
    cropped = ImageProcessor(224, center_crop=True).uint8_levels(images)
    assert max_level_difference(cropped, golden["cropped"]) <= 1
