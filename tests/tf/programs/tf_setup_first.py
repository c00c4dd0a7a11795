"""TensorFlow's set-up calls as the first lines of a program (tests/tf/test_setup_first.py and
tests/tf/test_tutorials.py run it through gpulab's runtime).

TensorFlow refuses each of these calls once it is initialised ("... cannot be modified after
being initialized"), so they succeed only if the program is the first to touch TensorFlow.
After them the program makes a strategy, then prints one line, ``RESULT {json}``: for each
call, ``"ok"`` or the error it raised (``setup``), and what TensorFlow reports once the
strategy is made (``after``, ``strategy``).

Where no GPU exists (here), two calls need a stand-in that TensorFlow allows on a CPU:

- memory growth: TensorFlow refuses memory growth on a CPU at any time (``ValueError: Cannot
  set memory growth on non-GPU and non-Pluggable devices``), so where it lists no GPU the
  program checks the condition ``set_memory_growth`` enforces on a GPU: that TensorFlow's eager
  context is not initialised yet (else it raises "Physical devices cannot be modified after
  being initialized"). With GPUs it sets memory growth on each.
- visible devices: with only a CPU, which must stay visible, making every device invisible and
  the CPU visible again are two changes that TensorFlow refuses once initialised ("Visible
  devices cannot be modified after being initialized"). With GPUs it keeps the first visible.

Usage: ``tf_setup_first.py HOW`` where HOW is ``gpulab`` (``runtime.strategy()``), ``own``
(the strategy TensorFlow's tutorials make from ``TF_CONFIG``), ``mirrored``
(``tf.distribute.MirroredStrategy()``), or a comma list of them picked by task index.
"""

import json
import os
import sys

from gpulab.extensions import runtime

import tensorflow as tf

setup = {}


def attempt(name, call):
    try:
        call()
        setup[name] = "ok"
    except Exception as e:  # noqa: BLE001 - reported, and the test says which
        setup[name] = f"{type(e).__name__}: {e}"


def memory_growth():
    gpus = tf.config.list_physical_devices("GPU")
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if not gpus:  # the stand-in (see above)
        from tensorflow.python.eager import context

        if context.context()._context_handle is not None:
            raise RuntimeError("Physical devices cannot be modified after being initialized "
                               "(stand-in: TensorFlow's context was initialised)")


def visible_devices():
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        tf.config.set_visible_devices(gpus[:1], "GPU")
    else:  # the stand-in (see above)
        cpus = tf.config.list_physical_devices("CPU")
        tf.config.set_visible_devices([])
        tf.config.set_visible_devices(cpus)


def virtual_devices():
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()])


def threading():
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)


attempt("memory_growth", memory_growth)
attempt("visible_devices", visible_devices)
attempt("virtual_devices", virtual_devices)
attempt("threading", threading)
# bfloat16: the mixed precision a CPU runs (mixed_float16 is for GPUs)
attempt("mixed_precision", lambda: tf.keras.mixed_precision.set_global_policy("mixed_bfloat16"))
attempt("xla", lambda: tf.config.optimizer.set_jit(True))

role, index = runtime.task()
choices = sys.argv[1].split(",")
how = choices[index % len(choices)]
if how == "gpulab":
    strategy = runtime.strategy()
    assert runtime.strategy() is strategy
elif how == "own":
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    if resolver.cluster_spec().as_dict().get("ps"):
        strategy = tf.distribute.ParameterServerStrategy(resolver)
    else:
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
else:
    strategy = tf.distribute.MirroredStrategy()


def mine(device_name):
    """Whether a logical device is this process's own (not a peer's of the cluster)."""
    spec = tf.DeviceSpec.from_string(device_name)
    return spec.job in (None, "localhost") or (spec.job == role and spec.task == index)


with strategy.scope():
    layer = tf.keras.layers.Dense(2)
    layer.build((None, 3))
if isinstance(strategy, tf.distribute.ParameterServerStrategy):
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        counter = tf.Variable(0.0)

    @tf.function
    def count():
        counter.assign_add(1.0)
        return counter.read_value()

    for _ in range(3):
        coordinator.schedule(count)
    coordinator.join()
    together = float(counter.numpy())
else:
    together = float(strategy.reduce(tf.distribute.ReduceOp.SUM,
                                     strategy.run(lambda: tf.constant(1.0)), axis=None))
resolver = getattr(strategy, "cluster_resolver", None)
gpus = tf.config.list_physical_devices("GPU")
result = {
    "how": how,
    "setup": setup,
    "after": {
        "memory_growth": [tf.config.experimental.get_memory_growth(g) for g in gpus]
        if gpus else "stand-in",
        "visible_devices": [d.name for d in tf.config.get_visible_devices()],
        "virtual_devices": [d.name for d in tf.config.list_logical_devices("CPU")
                            if mine(d.name)],
        "threading": [tf.config.threading.get_intra_op_parallelism_threads(),
                      tf.config.threading.get_inter_op_parallelism_threads()],
        "mixed_precision": [tf.keras.mixed_precision.global_policy().name,
                            layer.compute_dtype, layer.kernel.dtype.name],
        "xla": [tf.config.optimizer.get_jit(),
                float(tf.function(lambda x: x * 2.0, jit_compile=True)(tf.constant(3.0)))],
    },
    "strategy": {
        "type": type(strategy).__name__,
        "replicas": strategy.num_replicas_in_sync,
        "together": together,
        "cluster": resolver.cluster_spec().as_dict() if resolver is not None else None,
        "variables_on": counter.device
        if isinstance(strategy, tf.distribute.ParameterServerStrategy) else None,
        "devices": list(strategy.extended.worker_devices)
        if how == "mirrored" else None,
    },
    "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
}
print("RESULT " + json.dumps(result), flush=True)
