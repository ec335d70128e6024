"""TensorBoard's own event reader and hparams plugin, as the TensorBoard UI reads a logdir."""

from __future__ import annotations

from tensorboard import context
from tensorboard.backend.event_processing import data_provider
from tensorboard.backend.event_processing import plugin_event_multiplexer as pem
from tensorboard.plugins import base_plugin
from tensorboard.plugins.hparams import api_pb2, backend_context, list_session_groups
from tensorboard.util import tensor_util


def multiplexer(logdir: str) -> pem.EventMultiplexer:
    mux = pem.EventMultiplexer()
    mux.AddRunsFromDirectory(str(logdir))
    mux.Reload()
    return mux


def scalars(mux: pem.EventMultiplexer, run: str, tag: str) -> dict[int, float]:
    """``{step: value}`` of one scalar series (TensorBoard keeps scalars as tensors)."""
    return {e.step: float(tensor_util.make_ndarray(e.tensor_proto)) for e in mux.Tensors(run, tag)}


def hparams_tab(logdir: str) -> tuple[dict, dict]:
    """What the HPARAMS tab shows: ``({hparam: type}, {run: (hparams, {(group, tag): value})})``
    from the plugin's own experiment and session-group handlers."""
    mux = multiplexer(logdir)
    tb = backend_context.Context(
        base_plugin.TBContext(
            data_provider=data_provider.MultiplexerDataProvider(mux, str(logdir)),
            logdir=str(logdir),
            multiplexer=mux,
        )
    )
    ctx = context.RequestContext()
    found = tb.hparams_metadata(ctx, "")
    experiment = tb.experiment_from_metadata(
        ctx, "", True, found, tb.hparams_from_data_provider(ctx, "", 0)
    )
    infos = {i.name: api_pb2.DataType.Name(i.type) for i in experiment.hparam_infos}
    request = api_pb2.ListSessionGroupsRequest(
        start_index=0,
        slice_size=100,
        allowed_statuses=[api_pb2.STATUS_UNKNOWN, api_pb2.STATUS_SUCCESS],
        col_params=[api_pb2.ColParams(metric=m.name) for m in experiment.metric_infos],
    )
    groups = list_session_groups.Handler(ctx, tb, "", request).run().session_groups
    sessions = {}
    for g in groups:
        values = {k: getattr(v, v.WhichOneof("kind")) for k, v in g.hparams.items()}
        metrics = {(m.name.group, m.name.tag): m.value for m in g.metric_values}
        sessions[g.name] = (values, metrics)
    return infos, sessions
