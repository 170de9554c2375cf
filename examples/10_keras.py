"""A standard Keras 3 script with exact accumulation: one line changes, on any backend
(`KERAS_BACKEND=tensorflow python examples/10_keras.py`, or jax; torch when unset).

Keras's `SGD(gradient_accumulation_steps=4)` averages the 4 batch gradients with equal weights,
so the short last batch (100 = 3 x 32 + 4) would weigh as much as a full one.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras
import numpy as np

from bigbatch.integrations.keras import AccumulatingModel

keras.utils.set_random_seed(0)
x = np.random.randn(100, 20).astype("float32")
y = np.random.randint(0, 3, 100)
model = keras.Sequential(
    [keras.Input((20,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(3)]
)
model = AccumulatingModel(model, micro_batches=4)  # bigbatch: the one changed line
model.compile(
    optimizer=keras.optimizers.Adam(1e-3),
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
)
model.fit(x, y, batch_size=32, epochs=2, verbose=0)
steps = int(keras.ops.convert_to_numpy(model.optimizer.iterations))
print(f"optimizer steps: {steps} (one window of 32+32+32+4 per epoch)")
