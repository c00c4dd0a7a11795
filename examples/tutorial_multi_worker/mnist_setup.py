# From TensorFlow's tutorial "Multi-worker training with Keras"
# (https://www.tensorflow.org/tutorials/distribute/multi_worker_with_keras), unchanged but for
# its data source: random images and labels of MNIST's shapes instead of downloading MNIST
# (gpulab's training replicas have no network). Submitted with main.py as one gpulab job:
#     gpulab jobs submit --name mnist-mw --strategy multi-worker-mirrored --workers 2 \
#         --source-file examples/tutorial_multi_worker/
# See docs/from-a-tensorflow-tutorial.md.

import os
import tensorflow as tf
import numpy as np

def mnist_dataset(batch_size):
  # The tutorial: (x_train, y_train), _ = tf.keras.datasets.mnist.load_data()
  rng = np.random.default_rng(0)
  x_train = rng.integers(0, 256, size=(6000, 28, 28), dtype=np.uint8)
  y_train = rng.integers(0, 10, size=(6000,), dtype=np.uint8)
  # The `x` arrays are in uint8 and have values in the [0, 255] range.
  # You need to convert them to float32 with values in the [0, 1] range.
  x_train = x_train / np.float32(255)
  y_train = y_train.astype(np.int64)
  train_dataset = tf.data.Dataset.from_tensor_slices(
      (x_train, y_train)).shuffle(60000).repeat().batch(batch_size)
  return train_dataset

def build_and_compile_cnn_model():
  model = tf.keras.Sequential([
      tf.keras.layers.InputLayer(input_shape=(28, 28)),
      tf.keras.layers.Reshape(target_shape=(28, 28, 1)),
      tf.keras.layers.Conv2D(32, 3, activation='relu'),
      tf.keras.layers.Flatten(),
      tf.keras.layers.Dense(128, activation='relu'),
      tf.keras.layers.Dense(10)
  ])
  model.compile(
      loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
      optimizer=tf.keras.optimizers.SGD(learning_rate=0.001),
      metrics=['accuracy'])
  return model
