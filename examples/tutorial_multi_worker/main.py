# From TensorFlow's tutorial "Multi-worker training with Keras"
# (https://www.tensorflow.org/tutorials/distribute/multi_worker_with_keras), unchanged: the
# entry point of the job; mnist_setup.py travels with it. gpulab sets TF_CONFIG on every
# worker, and TensorFlow's own MultiWorkerMirroredStrategy() reads it.

import os
import json

import tensorflow as tf
import mnist_setup

per_worker_batch_size = 64
tf_config = json.loads(os.environ['TF_CONFIG'])
num_workers = len(tf_config['cluster']['worker'])

strategy = tf.distribute.MultiWorkerMirroredStrategy()

global_batch_size = per_worker_batch_size * num_workers
multi_worker_dataset = mnist_setup.mnist_dataset(global_batch_size)

with strategy.scope():
  # Model building/compiling need to be within `strategy.scope()`.
  multi_worker_model = mnist_setup.build_and_compile_cnn_model()


multi_worker_model.fit(multi_worker_dataset, epochs=3, steps_per_epoch=70)
