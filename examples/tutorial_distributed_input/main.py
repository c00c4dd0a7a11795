# TensorFlow's guide "Distributed input" (https://www.tensorflow.org/tutorials/distribute/input)
# as one program: its code cells in order, with the guide's own calls and its own data (small
# in-memory datasets already: nothing to change), written out for gpulab's tests rather than
# copied. Its first step sets up two logical CPUs, which TensorFlow allows only before it is
# initialised; each section then makes its own tf.distribute.MirroredStrategy(), as the
# guide's cells do. Submit it as a multi-worker-mirrored job with one worker.

import numpy as np
import tensorflow as tf

print(tf.__version__)

# -- simulate two CPUs with logical devices (the guide's first TensorFlow call)
N_VIRTUAL_DEVICES = 2
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(N_VIRTUAL_DEVICES)])

print("Available devices:")
for number, device in enumerate(tf.config.list_logical_devices()):
    print("%d) %s" % (number, device))


# -- a dataset without distribution
@tf.function
def train_step(inputs):
    features, labels = inputs
    return labels - 0.3 * features


global_batch_size = 16
plain = tf.data.Dataset.from_tensors(([1.], [1.])).repeat(100).batch(global_batch_size)
for inputs in plain:
    print(train_step(inputs))

# -- experimental_distribute_dataset: one global batch per step
mirrored_strategy = tf.distribute.MirroredStrategy()
dataset = tf.data.Dataset.from_tensors(([1.], [1.])).repeat(100).batch(global_batch_size)
dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)
print(next(iter(dist_dataset)))

# -- sharding: auto-shard by data
sharded = tf.data.Dataset.from_tensors(([1.], [1.])).repeat(64).batch(16)
shard_options = tf.data.Options()
shard_options.experimental_distribute.auto_shard_policy = \
    tf.data.experimental.AutoShardPolicy.DATA
sharded = sharded.with_options(shard_options)


# -- distribute_datasets_from_function: the input function batches and shards
def dataset_fn(input_context):
    per_replica = input_context.get_per_replica_batch_size(global_batch_size)
    ds = tf.data.Dataset.from_tensors(([1.], [1.])).repeat(64).batch(16)
    ds = ds.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
    return ds.batch(per_replica).prefetch(2)  # two batches ahead per device


mirrored_strategy = tf.distribute.MirroredStrategy()
from_function = mirrored_strategy.distribute_datasets_from_function(dataset_fn)

# -- distributed iterators: a Python for loop
mirrored_strategy = tf.distribute.MirroredStrategy()
dataset = tf.data.Dataset.from_tensors(([1.], [1.])).repeat(100).batch(global_batch_size)
dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)
for batch in dist_dataset:
    loss = mirrored_strategy.run(train_step, args=(batch,))
    print("Loss is ", loss)

# -- an explicit iterator, a fixed number of steps per epoch
num_epochs, steps_per_epoch = 10, 5
for epoch in range(num_epochs):
    dist_iterator = iter(dist_dataset)
    for step in range(steps_per_epoch):
        loss = mirrored_strategy.run(train_step, args=(next(dist_iterator),))
        print("Loss is ", loss)

# -- get_next_as_optional: stop a loop inside a tf.function when the data ends
global_batch_size = 4
steps_per_loop = 5
strategy = tf.distribute.MirroredStrategy()
short = tf.data.Dataset.range(9).batch(global_batch_size)
distributed_iterator = iter(strategy.experimental_distribute_dataset(short))


@tf.function
def train_fn(distributed_iterator):
    for _ in tf.range(steps_per_loop):
        optional_data = distributed_iterator.get_next_as_optional()
        if not optional_data.has_value():
            break
        per_replica_results = strategy.run(lambda x: x, args=(optional_data.get_value(),))
        tf.print(strategy.experimental_local_results(per_replica_results))


train_fn(distributed_iterator)

# -- element_spec as a tf.function's input signature
global_batch_size = 16
epochs, steps_per_epoch = 5, 5
mirrored_strategy = tf.distribute.MirroredStrategy()
dataset = tf.data.Dataset.from_tensors(([1.], [1.])).repeat(100).batch(global_batch_size)
dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)


@tf.function(input_signature=[dist_dataset.element_spec])
def doubled(per_replica_inputs):
    return mirrored_strategy.run(lambda inputs: 2 * inputs, args=(per_replica_inputs,))


for _ in range(epochs):
    iterator = iter(dist_dataset)
    for _ in range(steps_per_epoch):
        tf.print(doubled(next(iterator)))

# -- preprocessing in a custom training loop: the layer made in the strategy's scope
strategy = tf.distribute.MirroredStrategy()
vocab = ["a", "b", "c", "d", "f"]
with strategy.scope():
    lookup = tf.keras.layers.StringLookup(vocabulary=vocab)


def words_fn(input_context):
    words = tf.data.Dataset.from_tensor_slices(["a", "c", "e"]).repeat()
    words = words.batch(input_context.get_per_replica_batch_size(4))
    words = words.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
    return words.map(lambda w: lookup(w))


words_iterator = iter(strategy.distribute_datasets_from_function(words_fn))
for _ in range(3):
    print(next(words_iterator))

# -- caveats: put outputs back in order with an index per element
mirrored_strategy = tf.distribute.MirroredStrategy()
dataset_size, batch_size = 24, 6
indexed = tf.data.Dataset.range(dataset_size).enumerate().batch(batch_size)
dist_dataset = mirrored_strategy.experimental_distribute_dataset(indexed)


def predict(index, inputs):
    return index, 2 * inputs


result = {}
for index, inputs in dist_dataset:
    output_index, outputs = mirrored_strategy.run(predict, args=(index, inputs))
    indices = [i for part in mirrored_strategy.experimental_local_results(output_index)
               for i in part.numpy()]
    values = [v for part in mirrored_strategy.experimental_local_results(outputs)
              for v in part.numpy()]
    result.update(zip(indices, values))
print(result)

# -- tensor inputs instead of tf.data: experimental_distribute_values_from_function
mirrored_strategy = tf.distribute.MirroredStrategy()
distributed_values = mirrored_strategy.experimental_distribute_values_from_function(
    lambda ctx: tf.constant(ctx.replica_id_in_sync_group))
for _ in range(4):
    print(mirrored_strategy.run(lambda x: x, args=(distributed_values,)))

# -- a generator's data: tf.data.Dataset.from_generator
mirrored_strategy = tf.distribute.MirroredStrategy()


def input_gen():
    while True:
        yield np.random.rand(4)


generated = tf.data.Dataset.from_generator(
    input_gen, output_types=(tf.float32), output_shapes=tf.TensorShape([4]))
iterator = iter(mirrored_strategy.experimental_distribute_dataset(generated))
for _ in range(4):
    print(mirrored_strategy.run(lambda x: x, args=(next(iterator),)))
