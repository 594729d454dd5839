"""Write the golden outputs of OFT's image pipeline with TensorFlow (run by hand, never at run or test time).

OFT's LIBERO evaluation (moojink/openvla-oft experiments/robot/openvla_utils.py) JPEG-encodes each 256 px camera
image with ``tf.image.encode_jpeg`` (default quality), decodes it, resizes it to 224 px with
``tf.image.resize(method="lanczos3", antialias=True)``, rounds and clips to uint8, then (for models trained with
random crops) takes the 90 %-area centre crop with ``tf.image.crop_and_resize``. This script applies those TF ops
to ``--inputs`` (a .npy of uint8 [N, 256, 256, 3] images) and writes every stage to ``--out`` (.npz), which
tests/models/test_image_pipeline.py holds embodirl's numpy/torch re-implementation to.

    python3 -m venv /tmp/tfenv && /tmp/tfenv/bin/pip install tensorflow-cpu
    /tmp/tfenv/bin/python scripts/make_image_goldens.py --inputs images.npy --out tests/models/fixtures/oft_image_pipeline.npz
"""

import argparse

import numpy as np
import tensorflow as tf

SIZE = 224
CROP_AREA = 0.9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    images = np.load(args.inputs)
    jpeg, resized, cropped = [], [], []
    side = float(np.sqrt(CROP_AREA))
    lo = (1.0 - side) / 2.0
    for image in images:
        decoded = tf.io.decode_image(tf.image.encode_jpeg(image), expand_animations=False, dtype=tf.uint8)
        jpeg.append(decoded.numpy())
        small = tf.image.resize(decoded, (SIZE, SIZE), method="lanczos3", antialias=True)
        small = tf.cast(tf.clip_by_value(tf.round(small), 0, 255), tf.uint8)
        resized.append(small.numpy())
        x = tf.image.convert_image_dtype(small, tf.float32)[None]
        box = tf.constant([[lo, lo, lo + side, lo + side]], tf.float32)
        x = tf.image.crop_and_resize(x, box, tf.constant([0]), (SIZE, SIZE))[0]
        x = tf.image.convert_image_dtype(tf.clip_by_value(x, 0.0, 1.0), tf.uint8, saturate=True)
        cropped.append(x.numpy())
    np.savez_compressed(args.out, inputs=images, jpeg=np.stack(jpeg), resized=np.stack(resized),
                        cropped=np.stack(cropped), tensorflow=tf.__version__)


if __name__ == "__main__":
    main()
