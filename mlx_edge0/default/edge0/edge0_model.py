from mlx_edge0.plugin import bind; Model, ModelArgs = bind(__file__)  # noqa
