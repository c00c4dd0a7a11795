# TensorFlow's tutorial "Parameter server training with ParameterServerStrategy"
# (https://www.tensorflow.org/tutorials/distribute/parameter_server_training), its section
# "Training with Model.fit", run in a notebook whose kernel is the coordinator (tf-keras,
# `tf.keras` with TF_USE_LEGACY_KERAS=1, as gpulab's servers and jobs set it). The one line
# changed is the cluster's: the tutorial makes an in-process cluster
# (`create_in_process_cluster(NUM_WORKERS, NUM_PS)`); here gpulab holds one for the kernel.
# Checkpoints and summaries go to a folder of the person's (the tutorial's /tmp/my_working_dir).
import os

import gpulab
import tensorflow as tf

cluster_resolver = gpulab.cluster(ps=1, workers=2, name=CLUSTER_NAME).resolver  # the changed line

NUM_PS = cluster_resolver.cluster_spec().num_tasks("ps")
variable_partitioner = (
    tf.distribute.experimental.partitioners.MinSizePartitioner(
        min_shard_bytes=(256 << 10),
        max_shards=NUM_PS))

strategy = tf.distribute.ParameterServerStrategy(
    cluster_resolver,
    variable_partitioner=variable_partitioner)


def dataset_fn(input_context):
  global_batch_size = 64
  batch_size = input_context.get_per_replica_batch_size(global_batch_size)

  x = tf.random.uniform((10, 10))
  y = tf.random.uniform((10,))

  dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(10).repeat()
  dataset = dataset.shard(
      input_context.num_input_pipelines,
      input_context.input_pipeline_id)
  dataset = dataset.batch(batch_size)
  dataset = dataset.prefetch(2)

  return dataset


dc = tf.keras.utils.experimental.DatasetCreator(dataset_fn)

with strategy.scope():
  model = tf.keras.models.Sequential([tf.keras.layers.Dense(10)])

  model.compile(tf.keras.optimizers.legacy.SGD(), loss="mse", steps_per_execution=10)

working_dir = WORKING_DIR
log_dir = os.path.join(working_dir, "log")
ckpt_filepath = os.path.join(working_dir, "ckpt")
backup_dir = os.path.join(working_dir, "backup")

callbacks = [
    tf.keras.callbacks.TensorBoard(log_dir=log_dir),
    tf.keras.callbacks.ModelCheckpoint(filepath=ckpt_filepath),
    tf.keras.callbacks.BackupAndRestore(backup_dir=backup_dir),
]

history = model.fit(dc, epochs=2, steps_per_epoch=20, callbacks=callbacks)
print("FIT", len(history.history["loss"]), flush=True)
