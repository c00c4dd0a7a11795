"""Parameter-server training of a small digits classifier: a gpulab example.

Submit it as a ``parameter-server`` job, e.g. 1 chief + 1 ps + 2 workers. The gpulab runtime
starts a TensorFlow server on the ps and on each worker, and runs this file on the chief (the
coordinator), where ``runtime.strategy()`` makes a ``ParameterServerStrategy``: the variables
live on the ps and the training steps run on the workers. Run it alone first with
``python digits_parameter_server.py`` (one process, TensorFlow's default strategy).

What every job should do, shown here:

- build and compile the model inside ``runtime.strategy().scope()``;
- write TensorBoard summaries to ``runtime.logdir()``;
- back up to ``runtime.checkpoint_dir()`` every epoch with ``BackupAndRestore``, so that a
  restarted chief (gpulab restarts it after a ps is lost) resumes from the last finished epoch
  instead of starting again;
- ``runtime.report(...)`` its progress for the job view.

Under ParameterServerStrategy, ``Model.fit`` takes a ``DatasetCreator`` (each worker builds
its own input pipeline) and needs ``steps_per_epoch``.
"""

import argparse
import time

from gpulab.extensions import runtime  # first: it makes tf.keras the tf-keras that works here
from gpulab.extensions._digits import load_digits

import numpy as np
import tensorflow as tf

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--epochs", type=int, default=8)
parser.add_argument("--batch-size", type=int, default=64)
parser.add_argument("--sleep-per-epoch", type=float, default=0.0,
                    help="seconds to pause after each epoch (to slow it down in fault tests)")
args = parser.parse_args()

(x_train, y_train), (x_test, y_test) = load_digits()
steps_per_epoch = len(x_train) // args.batch_size


def dataset_fn(input_context):
    """Runs on each worker: an endless, shuffled stream of batches of that worker's shard."""
    ds = tf.data.Dataset.from_tensor_slices((x_train, y_train))
    ds = ds.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
    batch_size = input_context.get_per_replica_batch_size(args.batch_size)
    return ds.shuffle(len(x_train)).repeat().batch(batch_size).prefetch(2)


strategy = runtime.strategy()
with strategy.scope():
    model = tf.keras.Sequential([
        tf.keras.Input(shape=(64,)),
        tf.keras.layers.Dense(64, activation="relu"),
        tf.keras.layers.Dense(10),
    ])
    model.compile(
        optimizer=tf.keras.optimizers.Adam(0.01),
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )


class Progress(tf.keras.callbacks.Callback):
    """Says where training resumes, and reports each finished epoch to gpulab."""

    def on_train_begin(self, logs=None):
        self.first_epoch = True

    def on_epoch_begin(self, epoch, logs=None):
        if self.first_epoch and epoch > 0:
            print(f"resuming from epoch {epoch}", flush=True)
        self.first_epoch = False

    def on_epoch_end(self, epoch, logs=None):
        runtime.report((epoch + 1) * steps_per_epoch, total=args.epochs * steps_per_epoch,
                       epoch=epoch + 1, **(logs or {}))
        time.sleep(args.sleep_per_epoch)


model.fit(
    tf.keras.utils.experimental.DatasetCreator(dataset_fn),
    epochs=args.epochs,
    steps_per_epoch=steps_per_epoch,
    callbacks=[
        # first, so that an epoch is backed up before it is reported
        tf.keras.callbacks.BackupAndRestore(runtime.checkpoint_dir(), delete_checkpoint=False),
        tf.keras.callbacks.TensorBoard(runtime.logdir()),
        Progress(),
    ],
    verbose=2,
)

# the coordinator reads the trained variables from the ps and evaluates on the held-out split
logits = model(x_test, training=False)
accuracy = float(np.mean(np.argmax(logits, axis=1) == y_test))
print(f"test accuracy: {accuracy:.4f}")
