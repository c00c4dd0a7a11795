# From TensorFlow's tutorial "Parameter server training with ParameterServerStrategy"
# (https://www.tensorflow.org/tutorials/distribute/parameter_server_training): its Model.fit
# program with a DatasetCreator, in the form its section "Clusters in the real world" gives
# for a cluster described by TF_CONFIG. Unchanged; its data was random already.
#     gpulab jobs submit --name ps-tutorial --strategy parameter-server --ps 1 --workers 2 \
#         --source-file examples/tutorial_parameter_server/main.py
# In a gpulab job only the chief (the coordinator) runs this file: the ps and workers run
# gpulab's own tf.distribute.Server, so the server branch below is for other launchers. What
# it writes under /tmp lands in the job's private /tmp and goes with the job: to keep
# summaries and checkpoints, use runtime.logdir() and runtime.checkpoint_dir() (see
# docs/from-a-tensorflow-tutorial.md).

import os

import tensorflow as tf

cluster_resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
if cluster_resolver.task_type in ("worker", "ps"):
  # Start a TensorFlow server and wait.
  server = tf.distribute.Server(
      cluster_resolver.cluster_spec(),
      job_name=cluster_resolver.task_type,
      task_index=cluster_resolver.task_id,
      protocol=cluster_resolver.rpc_layer or "grpc",
      start=True)
  server.join()
elif cluster_resolver.task_type == "evaluator":
  # Run sidecar evaluation (this job has no evaluator)
  pass
else:
  # Run the coordinator.
  NUM_PS = cluster_resolver.cluster_spec().num_tasks("ps")

  variable_partitioner = (
      tf.distribute.experimental.partitioners.MinSizePartitioner(
          min_shard_bytes=(256 << 10),
          max_shards=NUM_PS))

  strategy = tf.distribute.experimental.ParameterServerStrategy(
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

  working_dir = "/tmp/my_working_dir"
  log_dir = os.path.join(working_dir, "log")
  ckpt_filepath = os.path.join(working_dir, "ckpt")
  backup_dir = os.path.join(working_dir, "backup")

  callbacks = [
      tf.keras.callbacks.TensorBoard(log_dir=log_dir),
      tf.keras.callbacks.ModelCheckpoint(filepath=ckpt_filepath),
      tf.keras.callbacks.BackupAndRestore(backup_dir=backup_dir),
  ]

  model.fit(dc, epochs=5, steps_per_epoch=20, callbacks=callbacks)
