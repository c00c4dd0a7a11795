"""Synchronous multi-worker training of a small digits classifier: a gpulab example.

Submit it as a ``multi-worker-mirrored`` job, e.g. 2 workers. The gpulab runtime runs this file
on every worker, where ``runtime.strategy()`` makes a ``MultiWorkerMirroredStrategy``: each step,
every worker computes gradients on its share of the global batch and they are summed across
the workers (all-reduce), so all of them hold the same weights. Run it alone first with
``python digits_multi_worker.py`` (one process, TensorFlow's default strategy).

What every job should do, shown here:

- build and compile the model inside ``runtime.strategy().scope()``;
- write TensorBoard summaries to ``runtime.logdir()``;
- back up to ``runtime.checkpoint_dir()`` every epoch with ``BackupAndRestore``: every worker
  must call it (the chief's backup is kept, the others' are temporary) and every worker restores
  the chief's, so that restarted workers (gpulab restarts all of them when one fails) resume
  together from the last finished epoch;
- ``runtime.report(...)`` its progress for the job view.

The same code runs on every worker; ``runtime.is_chief()`` tells the one whose output counts.
"""

import argparse
import time

from gpulab.extensions import runtime  # first: it makes tf.keras the tf-keras that works here
from gpulab.extensions._digits import load_digits

import tensorflow as tf

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--epochs", type=int, default=8)
parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
parser.add_argument("--sleep-per-epoch", type=float, default=0.0,
                    help="seconds to pause after each epoch (to slow it down in fault tests)")
args = parser.parse_args()

# the strategy first, before any other TensorFlow operation (TensorFlow's own rule for
# MultiWorkerMirroredStrategy); TensorFlow set-up such as tf.config.* would go just before it
strategy = runtime.strategy()

(x_train, y_train), (x_test, y_test) = load_digits()
steps_per_epoch = len(x_train) // args.batch_size

# the strategy splits each global batch among the workers
train = (tf.data.Dataset.from_tensor_slices((x_train, y_train))
         .shuffle(len(x_train), seed=0).repeat().batch(args.batch_size))
test = tf.data.Dataset.from_tensor_slices((x_test, y_test)).batch(args.batch_size)

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
    train,
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

# every worker takes part in the evaluation on the held-out split and gets the same result
_, accuracy = model.evaluate(test, verbose=0)
print(f"test accuracy: {accuracy:.4f}")
