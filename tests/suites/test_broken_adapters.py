"""Every suite module fails on at least one deliberately broken implementation, and every
wire-level check on the bug it exists for.

Each row runs one suite item in a child ``python -m pytest`` with
``--impl tests.suites.broken:<adapter>`` and requires it to fail with the expected
complaint (so a failure for an unrelated reason does not count). Adapters wrap torch's
``fully_shard`` (``*_torch``) where the bug would realistically sit in it, or the
reference. ``test_post_optim_event`` needs device events, and the stream breakages
(``broken_streams.py``) leave the numbers right: their rows run on the fake accelerator
(``--device fakeaccel``), whose stream checker fails them with its message
(:data:`UNORDERED`), or whose record of event waits the post-optim case reads.
"""

from __future__ import annotations

import pytest

from distconform.impl.torch_adapter import TorchImplementation
from tests.suites.child_session import failure_text, run_one_item


def row(
    module: str,
    item: str,
    adapter: str,
    complaint: str,
    *,
    fast: bool = False,
    options: tuple[str, ...] = (),
    torch_needs: str | None = None,
):
    """``torch_needs``: the capability a ``*_torch`` row's case requires, which the installed
    torch may lack (the case is then UNSUPPORTED there, and has nothing to fail)."""
    marks = [] if fast else [pytest.mark.slow]
    if torch_needs is not None:
        marks.append(
            pytest.mark.skipif(
                not TorchImplementation.capabilities >= {torch_needs},
                reason=f"this torch's FSDP2 has no {torch_needs}",
            )
        )
    return pytest.param(
        module, item, adapter, complaint, options, marks=marks, id=f"{module}-{adapter}"
    )


#: The post-optim event needs device events: these rows run on the fake accelerator.
ON_A_DEVICE = ("--device", "fakeaccel")

#: The stream checker's headline (harness/rank/stream_safety.py).
UNORDERED = "access(es) to device memory that no synchronisation orders"

SINGLE_GROUP = "test_train_parity_single_group_shard_dim0[ws2-lin_shapes=7x15_15x3]"


ROWS = [
    row(
        "test_training_parity",
        "test_train_parity_single_group_shard_dim0[ws2-lin_shapes=7x15_15x3]",
        "skip_grad_average",
        "gradient of",
        fast=True,
    ),
    row(
        "test_gradient_accumulation",
        "test_gradient_accumulation[ws2-mesh=1d-raf=True-mode=some_mlps-rab=True-offload=none-rso=False]",
        "ignore_gradient_sync",
        "collectives",
    ),
    # Quick items of the accumulation and 1F1B grids, so --quick fails these adapters too.
    row(
        "test_gradient_accumulation",
        "test_gradient_accumulation[ws2-mesh=1d-raf=True-mode=some_mlps-rab=True-offload=cpu-rso=False]",
        "ignore_gradient_sync",
        "collectives",
    ),
    row(
        "test_microbatching",
        "test_1f1b_microbatching[ws2-explicit_unshard=True-rab=False]",
        "skip_grad_average",
        "gradient of",
    ),
    row(
        "test_registration",
        "test_param_registration_after_backward[ws4-groups=multi-raf=True]",
        "never_reshard",
        "expected a DTensor",
    ),
    row(
        "test_hsdp",
        "test_train_parity_hsdp[ws4-raf=True-ac=False-mlp_dim=17-sync_last=True-offload=none]",
        "drop_hsdp_all_reduce_torch",
        "collectives",
    ),
    row(
        "test_world_size_1",
        "test_train_parity_single_worldsize1[ws1-lin_shapes=16x17_17x8]",
        "always_communicate",
        "collectives",
    ),
    row(
        "test_forward_inputs", "test_root_no_forward_inputs[ws2]", "skip_grad_average", "not close"
    ),
    row(
        "test_cast_after_init",
        "test_to_float64_after_init[ws2]",
        "skip_grad_average",
        "gradient of",
    ),
    row("test_non_root", "test_non_root_forward_backward[ws2]", "skip_grad_average", "gradient of"),
    row(
        "test_multi_forward",
        "test_multi_forward_module[ws2-raf=True]",
        "skip_grad_average",
        "gradient of",
    ),
    row(
        "test_forward_method",
        "test_register_fsdp_forward_method[ws2]",
        "skip_grad_average",
        "gradient of",
    ),
    row("test_prefetch", "test_explicit_prefetching[ws2]", "never_reshard", "gradient of"),
    row(
        "test_share_comm_ctx",
        "test_share_comm_context[ws2]",
        "skip_grad_average_torch",
        "gradient of",
    ),
    row(
        "test_activation_checkpointing",
        "test_train_parity_with_activation_checkpointing[ws2-raf=True-checkpoint=in_place-grouping=mem_eff]",
        "skip_grad_average_torch",
        "gradient of",
    ),
    row(
        "test_shared_params",
        "test_train_shared_params_uneven_shard[ws4-raf=True]",
        "skip_grad_average",
        "gradient of",
    ),
    row(
        "test_partial_forward",
        "test_double_partial_forward_then_backward[ws2]",
        "skip_grad_average",
        "gradient of",
    ),
    row(
        "test_microbatching",
        "test_1f1b_microbatching[ws2-explicit_unshard=False-rab=True]",
        "skip_grad_average",
        "gradient of",
    ),
    row(
        "test_shard_placement",
        "test_train_parity_shard_placement_fn_shard_largest_dim[ws2]",
        "skip_grad_average",
        "gradient of",
    ),
    # The wire: each of these leaves losses and gradients exact; the schedule check fails.
    row(
        "test_prefetch",
        "test_explicit_prefetching[ws2]",
        "ignore_forward_prefetch_torch",
        "(forward prefetch by layers.0) is due after `F> layers.0`",
    ),
    row(
        "test_prefetch",
        "test_explicit_prefetching[ws2]",
        "ignore_backward_prefetch_torch",
        "(backward prefetch by layers.7) is due after `B> layers.7`",
    ),
    row(
        "test_prefetch",
        "test_prefetch_list_order[ws2-forward=reversed-backward=reversed]",
        "reverse_backward_prefetch_torch",
        "out of order: expected all_gather",
    ),
    row(
        "test_prefetch",
        "test_implicit_backward_prefetch[ws2]",
        "no_implicit_prefetch_torch",
        "(implicit backward prefetch by root) is due after `B> root`",
    ),
    row(
        "test_reshard_after_forward",
        "test_reshard_after_forward_schedule[ws4-raf=2]",
        "int_reshard_as_true_torch",
        "missing: all_gather f32[16] over 2 consecutive world ranks [0, 1] (backward of root)",
    ),
    row(
        "test_mixed_precision",
        "test_bf16_training_parity[ws2-reduce=fp32]",
        "ignore_reduce_dtype_torch",
        "unexpected: reduce_scatter bf16",
    ),
    row(
        "test_reduce_controls",
        "test_divide_factor_and_sum_reduction[ws2-factor=3-force_sum=True]",
        "ignore_divide_factor_torch",
        "gradient of",
    ),
    row(
        "test_reduce_controls",
        "test_reduce_scatters_run_on_a_group_of_their_own[ws4]",
        "ignore_separate_reduce_scatter_group_torch",
        "ran on the all-gathers' group",
        torch_needs="separate_reduce_scatter_group",
    ),
    row(
        "test_reduce_controls",
        "test_parameters_unused_on_some_ranks_reduce_as_zeros[ws2]",
        "ignore_reduce_scatter_unused_params_torch",
        "model has none, reference has one",
        torch_needs="reduce_scatter_unused_params",
    ),
    row(
        "test_ignored_params",
        "test_ignored_params_stay_local_and_unreduced[ws2]",
        "ignore_ignored_params_torch",
        "the ignored weight became a DTensor",
    ),
    row(
        "test_offload",
        "test_cpu_offload_training_parity[ws2-raf=True]",
        "never_reshard_torch",
        "missing: all_gather",
    ),
    row(
        "test_unshard",
        "test_async_unshard_returns_before_its_all_gather_completes[ws2]",
        "blocking_async_unshard_torch",
        "waits for its all-gather to complete instead of returning a handle",
    ),
    row(
        "test_forward_method",
        "test_forward_method_hooks_run_on_every_call[ws2]",
        "forward_method_once_torch",
        "mixed torch.Tensor and DTensor",
    ),
    row(
        "test_errors",
        "test_reshard_after_forward_int_must_divide_the_shard_group[ws4-reshard_after_forward=3]",
        "int_reshard_as_true_torch",
        "DID NOT RAISE ValueError",
    ),
    row(
        "test_refusals",
        "test_undeclared_capability_is_refused[ws4-capability=gradient_accumulation]",
        "hidden_broken_gradient_sync",
        "accepted it silently",
    ),
    # At world size 2 the fp16/fp64 post factor is 1: only 4 ranks show a skipped post-divide.
    row(
        "test_reduce_controls",
        "test_every_reduction_path_divides_by_the_factor[ws4-mesh=1d-reduce=fp16-factor=none]",
        "skip_post_divide_torch",
        "max rel diff 1.0",
    ),
    row(
        "test_reduce_controls",
        "test_every_reduction_path_divides_by_the_factor[ws4-mesh=1d-reduce=fp64-factor=none]",
        "skip_post_divide",
        "max rel diff 1.0",
    ),
    row(
        "test_reduce_controls",
        "test_all_reduce_hook_sees_and_changes_each_reduced_gradient[ws4-mesh=hsdp]",
        "ignore_all_reduce_hook_torch",
        "ran 0 times",
    ),
    row(
        "test_custom_comms",
        "test_custom_collectives_replace_the_implementations[ws2-mesh=1d]",
        "ignore_custom_all_gather_torch",
        "forward with the custom all-gather's weights",
    ),
    row(
        "test_custom_comms",
        "test_custom_collectives_replace_the_implementations[ws4-mesh=hsdp]",
        "custom_all_gather_output_discarded_torch",
        "forward with the custom all-gather's weights",
    ),
    row(
        "test_custom_comms",
        "test_custom_collectives_replace_the_implementations[ws4-mesh=hsdp]",
        "ignore_custom_reduce_scatter_torch",
        "custom reduce-scatter of MLP 0 ran 0 times",
    ),
    row(
        "test_reduce_controls",
        "test_reduce_scatter_input_buffers_change_no_gradient[ws2-buffers=2]",
        "max_input_buffers_unchecked_torch",
        "a cap of 0 was accepted",
        torch_needs="reduce_scatter_max_input_buffers",
    ),
    row(
        "test_dp_mesh_dims",
        "test_named_data_parallel_dims_of_a_full_mesh[ws4-dims=hsdp]",
        "dp_mesh_dims_on_the_wrong_dim_torch",
        "placements of '0.in_proj.weight'",
        torch_needs="dp_mesh_dims",
    ),
    row(
        "test_manual_finalization",
        "test_finalize_backward_completes_the_step[ws2-async_op=True]",
        "finalize_backward_does_nothing_torch",
        "is a Parameter after finalize_backward, not a sharded DTensor",
        torch_needs="manual_backward_finalization",
    ),
    row(
        "test_unshard",
        "test_kept_unsharded_storage_survives_reshard[ws2]",
        "ignore_keep_unsharded_storage",
        "freed by reshard",
    ),
    row(
        "test_reduce_controls",
        "test_fp16_reduction_survives_a_sum_beyond_its_range[ws4]",
        "sum_before_divide_torch",
        "overflowed",
    ),
    row(
        "test_reduce_controls",
        "test_every_reduction_path_divides_by_the_factor"
        "[ws4-mesh=hsdp-reduce=fp64-factor=3-setter=reduce_scatter]",
        "ignore_reduce_scatter_divide_factor_torch",
        "gradient of",
    ),
    # The numbers-only TP cases (fsdp.tp.2d_mesh) pass on this one: the layout case catches it.
    row(
        "composition/test_tensor_parallel",
        "test_tp_layout_and_collectives[ws4-dim=16]",
        "fsdp_over_dim1_torch",
        "not the documented ColwiseParallel then fully_shard dim-0 chunk",
    ),
    row(
        "composition/test_tensor_parallel",
        "test_tp_layout_and_collectives[ws4-dim=3]",
        "always_communicate_torch",
        "collectives on the wrong group",
    ),
    row(
        "composition/test_pipeline",
        "test_microbatches_other_than_stages_scale_by_microbatches[ws4-1F1B-microbatches=more]",
        "pipeline_scales_by_stages_torch",
        "6 microbatches over 2 stages, scale_grads=True",
    ),
    row(
        "test_ignored_params",
        "test_replicate_ignored_params_stay_local_and_unreduced[ws2]",
        "ignore_ignored_params_torch",
        "the ignored weight became a DTensor",
    ),
    row(
        "test_state_dict",
        "test_state_dict_while_unsharded_is_sharded[ws2-how=raf_false_forward]",
        "state_dict_skips_reshard_torch",
        "not the sharded DTensor",
    ),
    row(
        "test_state_dict",
        "test_load_state_dict_while_unsharded_lands_in_the_sharded_parameters"
        "[ws2-how=explicit_unshard]",
        "load_into_unsharded",
        "Tensor-likes are not close",
    ),
    row(
        "test_post_optim_event",
        "test_post_optim_event[ws2]",
        "ignore_post_optim_event",
        "did not wait for the post-optim event recorded after step 0",
        fast=True,
        options=ON_A_DEVICE,
    ),
    row(
        "test_post_optim_event",
        "test_post_optim_event[ws2]",
        "stale_post_optim_event_torch",
        UNORDERED,
        options=ON_A_DEVICE,
    ),
    row(
        "test_post_optim_event",
        "test_post_optim_event[ws2]",
        "post_optim_event_kept_torch",
        UNORDERED,
        options=ON_A_DEVICE,
    ),
    # Each drops one synchronisation between streams; only the checker sees it.
    row(
        "test_training_parity",
        SINGLE_GROUP,
        "skip_all_gather_wait_torch",
        UNORDERED,
        fast=True,
        options=ON_A_DEVICE,
    ),
    row(
        "test_training_parity",
        SINGLE_GROUP,
        "skip_reduce_scatter_stream_wait_torch",
        UNORDERED,
        options=ON_A_DEVICE,
    ),
    row(
        "test_training_parity",
        SINGLE_GROUP,
        "skip_final_wait_torch",
        UNORDERED,
        options=ON_A_DEVICE,
    ),
    row(
        "test_training_parity",
        "test_train_parity_multi_group[ws2-raf=True-delays=none]",
        "free_reduce_scatter_input_early_torch",
        "uses memory allocated after a free",
        options=ON_A_DEVICE,
    ),
    row(
        "test_unshard",
        "test_async_unshard_returns_before_its_all_gather_completes[ws2]",
        "unshard_wait_on_wrong_stream",
        UNORDERED,
        options=ON_A_DEVICE,
    ),
    row(
        "test_unshard",
        "test_async_unshard_returns_before_its_all_gather_completes[ws2]",
        "unshard_wait_on_wrong_stream_torch",
        UNORDERED,
        options=ON_A_DEVICE,
    ),
    row(
        "test_post_optim_event",
        "test_replicate_post_optim_event[ws2]",
        "stale_post_optim_event",
        "waited on the post-optim event of step 0, a stale one",
        options=ON_A_DEVICE,
    ),
]


@pytest.mark.parametrize(("module", "item", "adapter", "complaint", "options"), ROWS)
def test_suite_fails_on_broken_adapter(tmp_path, module, item, adapter, complaint, options):
    nodeid = f"suites/{module}.py::{item}"
    failures, output = run_one_item(
        nodeid,
        ["--impl", f"tests.suites.broken:{adapter}", *options],
        tmp_path / "report.xml",
        600,
    )
    assert failures, f"{nodeid} did not fail on {adapter}:\n{output[-3000:]}"
    message = failure_text(failures)
    assert complaint in message, (
        f"{nodeid} failed on {adapter}, but not with {complaint!r}:\n{message[-3000:]}"
    )
