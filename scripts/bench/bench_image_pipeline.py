"""Time the policy's image pipeline on a batch of camera images: OFT's (JPEG round trip + TF lanczos3 + centre
crop, what ImageProcessor runs now) next to the earlier torch-only path (antialiased bicubic + centre crop).

    python scripts/bench/bench_image_pipeline.py [--batch 16] [--size 256] [--repeats 30]

Prints the median milliseconds per batch of each and their ratio; images are 256 px LIBERO-like noise-free
gradients (the JPEG codec's time depends a little on content).
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from embodirl.models.processor import (
    CENTER_CROP_AREA,
    TF_FLOAT_TO_UINT8_SCALE,
    UINT8_MAX,
    ImageProcessor,
    jpeg_round_trip,
    tf_center_crop_and_resize,
)


def bicubic_path(images: torch.Tensor, size: int) -> torch.Tensor:
    """The pipeline before OFT's: antialiased bicubic resize, rounded, then the same centre crop."""
    B, V, C, h, w = images.shape
    x = images.reshape(B * V, C, h, w).float()
    x = F.interpolate(x, size=(size, size), mode="bicubic", antialias=True, align_corners=False).round().clamp(0, 255)
    x = tf_center_crop_and_resize(x / UINT8_MAX, CENTER_CROP_AREA, size).clamp(0.0, 1.0)
    return torch.trunc(x * TF_FLOAT_TO_UINT8_SCALE)


def median_ms(fns: dict, repeats: int) -> dict[str, float]:
    """Median milliseconds of each callable, called in turn (A B C A B C ...) so that load from other
    processes hits all alike."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # warm-up (weight matrices cached, allocator warm)
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16, help="images per batch (B * V)")
    parser.add_argument("--size", type=int, default=256, help="camera resolution")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    ramp = torch.linspace(0, 255, args.size)
    base = (ramp[None, :] * 0.6 + ramp[:, None] * 0.4)                                  # (h, w)
    noise = torch.randint(0, 24, (args.batch, 3, args.size, args.size), generator=g).float()
    images = (base + noise).clamp(0, 255).to(torch.uint8)[:, None]                      # (N, 1, 3, h, w)
    torch.set_num_threads(args.threads)
    processor = ImageProcessor(224, center_crop=True)
    ms = median_ms({"oft": lambda: processor.uint8_levels(images), "jpeg": lambda: jpeg_round_trip(images[:, 0]),
                    "old": lambda: bicubic_path(images, 224)}, args.repeats)
    oft, jpeg, old = ms["oft"], ms["jpeg"], ms["old"]
    print(f"{args.batch} images {args.size} px -> 224 px, torch threads {torch.get_num_threads()}")
    print(f"  bicubic (before)          {old:8.2f} ms")
    print(f"  OFT (JPEG+lanczos3+crop)  {oft:8.2f} ms   (JPEG round trip alone {jpeg:.2f} ms)")
    print(f"  ratio OFT / bicubic       {oft / old:8.2f}x")


if __name__ == "__main__":
    main()
