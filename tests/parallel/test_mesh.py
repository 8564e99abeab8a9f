import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from lhc import parallel


def test_resolve_mesh_shape():
    assert parallel.resolve_mesh_shape((-1, 2, 1), 8) == (4, 2, 1, 1)  # a 3-tuple: no sequence axis
    assert parallel.resolve_mesh_shape((2, 2, 2), 8) == (2, 2, 2, 1)
    with pytest.raises(ValueError, match="at most one -1"):
        parallel.resolve_mesh_shape((-1, -1, 1), 8)
    with pytest.raises(ValueError, match="not divisible by 3"):
        parallel.resolve_mesh_shape((-1, 3, 1), 8)
    with pytest.raises(ValueError, match="needs 4 devices, but 8"):
        parallel.resolve_mesh_shape((2, 2, 1), 8)
    with pytest.raises(ValueError, match="one size per axis"):
        parallel.resolve_mesh_shape((8,), 8)


class _Dense(nn.Module):
    @nn.compact
    def __call__(self, x):
        kernel = self.param(
            "kernel", nn.with_logical_partitioning(nn.initializers.ones, ("embed", "mlp")), (4, 6)
        )
        return x @ kernel


def test_sharded_init_unboxes_and_places_with_rules():
    mesh = parallel.make_mesh((-1, 1, 1))
    model = _Dense()
    params, shardings = parallel.sharded_init(
        lambda rng: model.init(rng, jnp.ones((2, 4)))["params"],
        mesh,
        parallel.LOGICAL_AXIS_RULES,
        jax.random.key(0),
    )
    assert isinstance(params["kernel"], jax.Array)
    assert params["kernel"].shape == (4, 6) and float(params["kernel"].sum()) == 24.0
    assert shardings["kernel"].spec == jax.sharding.PartitionSpec("fsdp", "tensor")


def test_rules_from_config_converts_lists():
    import ml_collections

    config = ml_collections.ConfigDict({"logical_axis_rules": [("act_batch", ["data", "fsdp"])]})
    assert parallel.rules_from_config(config) == (("act_batch", ("data", "fsdp")),)
    assert parallel.rules_from_config(ml_collections.ConfigDict()) == parallel.LOGICAL_AXIS_RULES
