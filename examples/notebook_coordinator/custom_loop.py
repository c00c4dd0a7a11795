# TensorFlow's tutorial "Parameter server training with ParameterServerStrategy"
# (https://www.tensorflow.org/tutorials/distribute/parameter_server_training), its section
# "Training with a custom training loop", run in a notebook whose kernel is the coordinator.
# The one line changed is the cluster's: the tutorial makes an in-process cluster
# (`create_in_process_cluster(NUM_WORKERS, NUM_PS)`); here gpulab holds one for the kernel.
# Its data and model are the tutorial's shape at a smaller size (random features, a binary
# label; one Dense layer) so that it runs on a CPU in seconds.
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


def dataset_fn(_):
  x = tf.random.uniform((64, 8))
  y = tf.cast(tf.reduce_sum(x, axis=1, keepdims=True) > 4.0, tf.int64)
  return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(64).repeat().batch(16)


with strategy.scope():
  model = tf.keras.models.Sequential([tf.keras.layers.Dense(1, activation="sigmoid")])
  optimizer = tf.keras.optimizers.legacy.RMSprop(learning_rate=0.1)
  accuracy = tf.keras.metrics.Accuracy()


@tf.function
def step_fn(iterator):

  def replica_fn(batch_data, labels):
    with tf.GradientTape() as tape:
      pred = model(batch_data, training=True)
      per_example_loss = tf.keras.losses.BinaryCrossentropy(
          reduction=tf.keras.losses.Reduction.NONE)(labels, pred)
      loss = tf.nn.compute_average_loss(per_example_loss)
      model_losses = model.losses
      if model_losses:
        loss += tf.nn.scale_regularization_loss(tf.add_n(model_losses))

    gradients = tape.gradient(loss, model.trainable_variables)

    optimizer.apply_gradients(zip(gradients, model.trainable_variables))

    actual_pred = tf.cast(tf.greater(pred, 0.5), tf.int64)
    accuracy.update_state(labels, actual_pred)
    return loss

  batch_data, labels = next(iterator)
  losses = strategy.run(replica_fn, args=(batch_data, labels))
  return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)


coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)


@tf.function
def per_worker_dataset_fn():
  return strategy.distribute_datasets_from_function(dataset_fn)


per_worker_dataset = coordinator.create_per_worker_dataset(per_worker_dataset_fn)
per_worker_iterator = iter(per_worker_dataset)

num_epochs = NUM_EPOCHS
steps_per_epoch = 5
for i in range(num_epochs):
  accuracy.reset_states()
  for _ in range(steps_per_epoch):
    coordinator.schedule(step_fn, args=(per_worker_iterator,))
  # Wait at epoch boundaries.
  coordinator.join()
  print("Finished epoch %d, accuracy is %f." % (i, accuracy.result().numpy()), flush=True)

loss = coordinator.schedule(step_fn, args=(per_worker_iterator,))
print("Final loss is %f" % loss.fetch())
