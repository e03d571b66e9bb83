"""Behaviour of oss_plus.OSS beyond parity: inputs, groups, trainability, state dicts."""

import copy

import pytest
import torch
import torch.distributed as dist
from helpers import (
    backward,
    batch,
    catch,
    clone_model,
    flat_params,
    load_flat,
    make_model,
    params_equal,
    sgd_pair,
    state_equal,
    train,
)

from oss_plus import OSS


# ------------------------------------------------------------------ inputs and stepping
def _params_in_form(model, form):
    params = list(model.parameters())
    if form == "generator":
        return model.parameters()
    if form == "named":
        return model.named_parameters()
    if form == "groups":
        return [{"params": params[:2]}, {"params": params[2:]}]
    return params


def input_forms_task(ctx):
    results = []
    for form in ("generator", "list", "named", "groups"):
        model = make_model()
        ref_model = clone_model(model)
        opt = OSS(_params_in_form(model, form), optim=torch.optim.Adam, group=ctx.group, lr=0.01)
        train(model, opt, 3)
        train(ref_model, torch.optim.Adam(ref_model.parameters(), lr=0.01), 3)
        results.append((form, params_equal(model, ref_model)))
    return results


def test_accepts_generators_lists_named_parameters_and_groups(pool):
    for rank_result in pool.run(input_forms_task, world_size=2):
        assert all(ok for _, ok in rank_result), rank_result


def named_state_dict_task(ctx):
    model = make_model()
    opt = OSS(
        model.named_parameters(), optim=torch.optim.SGD, group=ctx.group, lr=0.1, momentum=0.9
    )
    train(model, opt, 1)
    sd = opt.state_dict(all_ranks=True)
    return sd["param_groups"][0]["param_names"], [
        g.get("param_names") for g in opt.optim.param_groups
    ]


def test_named_parameters_keep_names_in_state_dict(pool):
    names, local = pool.run(named_state_dict_task, world_size=2)[1]
    assert names == [n for n, _ in make_model().named_parameters()]
    assert local[0] and set(local[0]) < set(names)


class KwargSGD(torch.optim.SGD):
    def step(self, closure=None, scale=1.0):
        for group in self.param_groups:
            group["seen_scale"] = scale
        return super().step(closure)


def closure_and_kwargs_task(ctx):
    model = make_model()
    opt = OSS(model.parameters(), optim=KwargSGD, group=ctx.group, lr=0.1)

    def closure():
        opt.zero_grad()
        return backward(model, 0)

    loss = opt.step(closure, scale=3.0)
    return (
        float(loss),
        opt.param_groups[0]["seen_scale"],
        float(make_model()(torch.zeros(1, 6)).sum()),
    )


def test_step_returns_closure_loss_passes_kwargs_and_copies_new_keys_back(pool):
    results = pool.run(closure_and_kwargs_task, world_size=2)
    expected = (
        make_model()(torch.randn(5, 6, generator=torch.Generator().manual_seed(100)))
        .pow(2)
        .mean()
        .item()
    )
    for loss, seen, _ in results:
        assert loss == pytest.approx(expected)
        assert seen == 3.0  # a key the inner optimizer added reached the global groups


def scheduler_task(ctx):
    model = make_model()
    ref_model = clone_model(model)
    opt = OSS(model.parameters(), optim=torch.optim.SGD, group=ctx.group, lr=0.5, momentum=0.9)
    ref = torch.optim.SGD(ref_model.parameters(), lr=0.5, momentum=0.9)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (opt, ref)]
    for step in range(4):
        for m, o, s in ((model, opt, scheds[0]), (ref_model, ref, scheds[1])):
            o.zero_grad()
            backward(m, step)
            o.step()
            s.step()
    return (
        params_equal(model, ref_model),
        opt.optim.param_groups[0]["lr"],
        opt.param_groups[0]["lr"],
    )


def test_lr_scheduler_reaches_the_local_optimizer(pool):
    for same, inner_lr, lr in pool.run(scheduler_task, world_size=3):
        assert same
        assert lr == 0.5 * 0.5**4
        assert inner_lr == 0.5 * 0.5**3  # synced at the next step, like fairscale


def zero_grad_task(ctx):
    model = make_model()
    opt = OSS(model.parameters(), group=ctx.group, lr=0.1)
    backward(model, 0)
    opt.zero_grad()
    none = all(p.grad is None for p in model.parameters())
    backward(model, 0)
    opt.zero_grad(set_to_none=False)
    zeros = all(p.grad is not None and not p.grad.any() for p in model.parameters())
    return none and zeros


def test_zero_grad_covers_all_params(pool):
    assert all(pool.run(zero_grad_task, world_size=2))


# ------------------------------------------------------------------ layout and sync
def bucket_task(ctx):
    model = make_model()
    frozen = list(model.parameters())[0]
    frozen.requires_grad_(False)
    opt = OSS(model.parameters(), optim=torch.optim.Adam, group=ctx.group, lr=0.01)
    buffers = [b.buffer.data_ptr() for b in opt.sync_buckets.buckets]
    train(model, opt, 3)
    same_buffers = buffers == [b.buffer.data_ptr() for b in opt.sync_buckets.buckets]
    views = all(  # each param's memory lies in its bucket (its storage object is its own)
        b.buffer.data_ptr() <= p.data_ptr()
        and p.data_ptr() + p.nbytes <= b.buffer.data_ptr() + b.buffer.nbytes
        for b in opt.sync_buckets.buckets
        for p in b.params
    )
    ascending = all(
        [p.numel() for p in b.params] == sorted(p.numel() for p in b.params)
        for b in opt.sync_buckets.buckets
    )
    bucketed = {id(p) for b in opt.sync_buckets.buckets for p in b.params}
    only_trainable = bucketed == {id(p) for p in model.parameters() if p.requires_grad}
    aligned = all(p.data_ptr() % 64 == 0 for b in opt.sync_buckets.buckets for p in b.params)
    owners = {b.owner for b in opt.sync_buckets.buckets}
    return (
        same_buffers,
        views,
        ascending,
        only_trainable,
        aligned,
        len(opt.sync_buckets.buckets),
        owners,
    )


def test_one_preallocated_flat_bucket_per_owner_and_frozen_params_never_sent(pool):
    for same, views, ascending, only_trainable, aligned, count, owners in pool.run(
        bucket_task, world_size=2
    ):
        assert same and views and ascending and aligned
        assert only_trainable  # the frozen param is not on the wire
        assert count == len(owners) == 2


def realloc_task(ctx):
    model, ref_model, opt, ref = sgd_pair(ctx)
    train(model, opt, 1)
    train(ref_model, ref, 1)
    for p in model.parameters():  # what module.to(...) / .double().float() does
        p.data = p.data.clone()
    train(model, opt, 2, start=1)
    train(ref_model, ref, 2, start=1)
    return params_equal(model, ref_model), flat_params(model)


def test_params_reallocated_after_construction_are_rebucketed(pool):
    results = pool.run(realloc_task, world_size=2)
    assert all(same for same, _ in results)
    assert torch.equal(results[0][1], results[1][1])


def mixed_dtype_task(ctx):
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(5))
    b = torch.nn.Parameter(torch.randn(7, dtype=torch.float64))
    c = torch.nn.Parameter(torch.randn(3))
    ref = [torch.nn.Parameter(t.detach().clone()) for t in (a, b, c)]
    opt = OSS(
        [{"params": []}, {"params": [a, b, c]}], optim=torch.optim.Adam, group=ctx.group, lr=0.1
    )
    ref_opt = torch.optim.Adam([{"params": []}, {"params": ref}], lr=0.1)
    for _ in range(3):
        for params, o in (((a, b, c), opt), (ref, ref_opt)):
            o.zero_grad()
            sum((p.double() ** 2).sum() for p in params).backward()
            o.step()
    return all(torch.equal(x, y) for x, y in zip((a, b, c), ref)), b.dtype


def test_mixed_dtypes_and_an_empty_first_group(pool):
    for same, dtype in pool.run(mixed_dtype_task, world_size=2):
        assert same and dtype == torch.float64


def independent_groups_task(ctx):
    """Ranks (0, 1) and (2, 3) train the same model on different data, each over its own
    group; each must equal plain Adam on its own data."""
    mine = ctx.groups[(0, 1)] if ctx.global_rank < 2 else ctx.groups[(2, 3)]
    model = make_model()
    ref_model = clone_model(model)
    opt = OSS(model.parameters(), optim=torch.optim.Adam, group=mine, lr=0.01)
    ref = torch.optim.Adam(ref_model.parameters(), lr=0.01)
    pair = ctx.global_rank // 2

    def loss_fn(m, step):
        return m(batch(step, rank=pair)).pow(2).mean()

    train(model, opt, 2, loss_fn=loss_fn)
    train(ref_model, ref, 2, loss_fn=loss_fn)
    return flat_params(model), params_equal(model, ref_model)


def test_two_independent_groups_at_once(pool):
    r = pool.run(independent_groups_task, ranks=(0, 1, 2, 3))
    assert all(exact for _, exact in r), "a group differs from plain Adam on its data"
    assert not torch.equal(r[0][0], r[2][0])  # the groups did not mix


# ------------------------------------------------------------------ trainability
def add_group_task(ctx):
    """fairscale #3: freeze, train, then add a group; no param with state may move."""
    model = make_model()
    ref_model = clone_model(model)
    extra = torch.nn.Parameter(torch.randn(40, generator=torch.Generator().manual_seed(5)))
    ref_extra = torch.nn.Parameter(extra.detach().clone())
    opt = OSS(model.parameters(), optim=torch.optim.SGD, group=ctx.group, lr=0.1, momentum=0.9)
    ref = torch.optim.SGD(ref_model.parameters(), lr=0.1, momentum=0.9)
    train(model, opt, 2)
    train(ref_model, ref, 2)
    before = dict(opt.param_to_rank)
    list(model.parameters())[0].requires_grad_(False)  # trainability changes, no refresh yet
    list(ref_model.parameters())[0].requires_grad_(False)
    opt.add_param_group({"params": [extra], "lr": 0.05})
    ref.add_param_group({"params": [ref_extra], "lr": 0.05})
    kept = all(before[p] == opt.param_to_rank[p] for p in before)
    for step in range(2, 5):
        for m, e, o in ((model, extra, opt), (ref_model, ref_extra, ref)):
            o.zero_grad()
            (m(torch.ones(1, 6) * step).sum() * e.sum()).backward()
            o.step()
    return (
        kept,
        params_equal(model, ref_model) and torch.equal(extra, ref_extra),
        flat_params(model),
    )


def test_add_param_group_never_moves_params_with_state(pool):
    results = pool.run(add_group_task, world_size=3)
    for kept, exact, params in results:
        assert kept
        assert exact, "updates lost after add_param_group (fairscale #3)"
        assert torch.equal(params, results[0][2])


def added_frozen_then_unfrozen_task(ctx):
    """torch ZeRO #1: a group added frozen and unfrozen later must be broadcast."""
    model = make_model()
    ref_model = clone_model(model)
    extra = torch.nn.Parameter(torch.ones(30), requires_grad=False)
    ref_extra = torch.nn.Parameter(torch.ones(30), requires_grad=False)
    opt = OSS(model.parameters(), optim=torch.optim.SGD, group=ctx.group, lr=0.1)
    ref = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    opt.add_param_group({"params": [extra]})
    ref.add_param_group({"params": [ref_extra]})
    extra.requires_grad_(True)
    ref_extra.requires_grad_(True)
    for _ in range(2):
        for e, o in ((extra, opt), (ref_extra, ref)):
            o.zero_grad()
            (e * 3).sum().backward()
            o.step()
    return extra.detach().clone(), torch.equal(extra, ref_extra)


def test_group_added_frozen_then_unfrozen_is_synced(pool):
    results = pool.run(added_frozen_then_unfrozen_task, world_size=2)
    assert all(ok for _, ok in results)
    assert torch.equal(results[0][0], results[1][0])
    assert torch.allclose(results[0][0], torch.full((30,), 1 - 2 * 0.3))


def refresh_task(ctx, automatic):
    torch.manual_seed(0)
    big = [torch.nn.Parameter(torch.randn(50)) for _ in range(4)]
    small = [torch.nn.Parameter(torch.randn(5)) for _ in range(4)]
    params = big + small
    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = OSS(params, optim=torch.optim.SGD, group=ctx.group, lr=0.1, momentum=0.9)
    ref = torch.optim.SGD(ref_params, lr=0.1, momentum=0.9)

    def step(step_no):
        for ps, o in ((params, opt), (ref_params, ref)):
            o.zero_grad()
            sum(
                ((p * (i + step_no + 1)) ** 2).sum() for i, p in enumerate(ps) if p.requires_grad
            ).backward()
            o.step()

    step(0)
    step(1)
    owners_before = [opt.param_to_rank[p] for p in params]
    for ps in (params, ref_params):
        for p in (ps[0], ps[2]):
            p.requires_grad_(False)
    if not automatic:
        opt.refresh_trainable()
    step(2)
    owners_mid = [opt.param_to_rank[p] for p in params]
    for ps in (params, ref_params):
        for p in (ps[0], ps[2]):
            p.requires_grad_(True)
    step(3)
    step(4)
    exact = all(torch.equal(a, b) for a, b in zip(params, ref_params))
    momentum_kept = all(
        "momentum_buffer" in opt.optim.state[p] for p in params if opt.param_to_rank[p] == ctx.rank
    )
    return owners_before, owners_mid, exact, momentum_kept, torch.cat([p.detach() for p in params])


@pytest.mark.parametrize("automatic", [False, True], ids=["explicit", "at_step"])
def test_refresh_trainable_repartitions_and_keeps_state(pool, automatic):
    results = pool.run(refresh_task, automatic, world_size=2)
    before, mid, _, _, _ = results[0]
    assert before != mid, "refresh_trainable did not repartition (fairscale #4)"
    # balanced over what is trainable now: two big frozen params weigh 1 each
    for _, _, exact, momentum_kept, params in results:
        assert exact, "a param lost its momentum when it changed owner"
        assert momentum_kept
        assert torch.equal(params, results[0][4])


# ------------------------------------------------------------------ state dicts
def consolidate_task(ctx, recipient):
    model = make_model()
    ref_model = clone_model(model)
    opt = OSS(model.parameters(), optim=torch.optim.Adam, group=ctx.group, lr=0.01)
    ref = torch.optim.Adam(ref_model.parameters(), lr=0.01)
    before = catch(opt.state_dict)
    train(model, opt, 2)
    train(ref_model, ref, 2)
    opt.consolidate_state_dict(recipient_rank=recipient)
    got = catch(opt.state_dict)
    torch.distributed.barrier(group=ctx.group)  # each rank's optimizer lives until all read
    if got[0] != "ok":
        return before, got, None, opt.consolidated_state is None
    sd = got[1]
    plain = torch.optim.Adam(clone_model(model).parameters(), lr=0.01)
    plain.load_state_dict(copy.deepcopy(sd))
    return before, ("ok", None), state_equal(sd, ref.state_dict()), True


@pytest.mark.parametrize("recipient", [0, 1, -1])
def test_consolidate_state_dict_on_one_or_all_ranks(pool, recipient):
    results = pool.run(consolidate_task, recipient, world_size=3)
    for before, got, equal, _ in results:
        assert before[0] == "ok" and before[1]["state"] == {}  # read here (issue 56): no state yet
        # the recipient consolidated; the others read the shards themselves (issue 56)
        assert got[0] == "ok" and equal, "consolidated state differs from the unsharded one"


def all_ranks_task(ctx):
    model, ref_model, opt, ref = sgd_pair(ctx)
    train(model, opt, 2)
    train(ref_model, ref, 2)
    sd = opt.state_dict(all_ranks=True)  # like torch's, it references the live state
    equal = state_equal(sd, ref.state_dict())
    train(model, opt, 1, start=2)
    train(ref_model, ref, 1, start=2)
    fresh = opt.state_dict()  # the copy was dropped at the step: read again (issue 56)
    torch.distributed.barrier(group=ctx.group)  # each rank's optimizer lives until all read
    return equal, sorted(sd["state"]), state_equal(fresh, ref.state_dict())


def test_state_dict_all_ranks_and_the_copy_is_dropped_at_the_next_step(pool):
    for equal, keys, fresh in pool.run(all_ranks_task, ranks=(2, 3)):
        assert equal, "state_dict(all_ranks=True) differs from the plain SGD's on this rank"
        assert keys == list(range(8))
        assert fresh, "state_dict() after the next step is not the plain SGD's of that step"


def save_task(ctx, name, steps):
    model = make_model()
    optim = {"adam": torch.optim.Adam, "sgd": torch.optim.SGD}[name]
    opt = OSS(
        model.parameters(),
        optim=optim,
        group=ctx.group,
        lr=0.01,
        **({"momentum": 0.9} if name == "sgd" else {}),
    )
    train(model, opt, steps)
    return opt.state_dict(all_ranks=True), flat_params(model)


def load_task(ctx, sd, params, name, steps):
    model = make_model()
    # copied in (vector_to_parameters would make the params unaligned views of ``params``,
    # which OSS keeps as they are at world size 1, and the aligned clone below differs in
    # the last bit of vectorized kernels)
    load_flat(model, params)
    ref_model = clone_model(model)
    optim = {"adam": torch.optim.Adam, "sgd": torch.optim.SGD}[name]
    kw = {"momentum": 0.9} if name == "sgd" else {}
    opt = OSS(model.parameters(), optim=optim, group=ctx.group, lr=0.5, **kw)
    ref = optim(ref_model.parameters(), lr=0.5, **kw)
    original = copy.deepcopy(sd)
    opt.load_state_dict(sd)
    untouched = state_equal(sd, original)
    ref.load_state_dict(copy.deepcopy(sd))
    train(model, opt, steps, start=10)
    train(ref_model, ref, steps, start=10)
    return (
        untouched and state_equal(sd, original),
        params_equal(model, ref_model),
        opt.param_groups[0]["lr"],
    )


@pytest.mark.parametrize("name", ["adam", "sgd"])
def test_load_state_dict_at_any_world_size_without_mutating_it(pool, name):
    sd, params = pool.run(save_task, name, 3, world_size=2)[0]
    for world in ({"world_size": 1}, {"world_size": 3}, {"world_size": 4}, {"ranks": (2, 3)}):
        for untouched, same, lr in pool.run(load_task, sd, params, name, 3, **world):
            assert untouched, "load_state_dict mutated the caller's dict"
            assert same
            assert lr == 0.01  # hyperparameters come from the state dict


def plain_to_oss_task(ctx):
    model = make_model()
    ref_model = clone_model(model)
    ref = torch.optim.Adam(ref_model.parameters(), lr=0.01)
    train(ref_model, ref, 2)
    opt = OSS(model.parameters(), optim=torch.optim.Adam, group=ctx.group, lr=0.01)
    with torch.no_grad():
        for p, q in zip(model.parameters(), ref_model.parameters()):
            p.copy_(q)
    opt.load_state_dict(ref.state_dict())
    train(model, opt, 2, start=2)
    train(ref_model, ref, 2, start=2)
    return params_equal(model, ref_model)


def test_load_a_plain_torch_state_dict(pool):
    assert all(pool.run(plain_to_oss_task, world_size=3))


def bad_load_task(ctx):
    model = make_model()
    opt = OSS(model.parameters(), optim=torch.optim.Adam, group=ctx.group, lr=0.01)
    good = torch.optim.Adam(clone_model(model).parameters(), lr=0.01)
    other = torch.optim.Adam(make_model(width=7).parameters(), lr=0.01)
    for p in other.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    other.step()
    sd = good.state_dict()
    two_groups = {
        "state": {},
        "param_groups": [
            dict(sd["param_groups"][0], params=[0, 1]),
            dict(sd["param_groups"][0], params=list(range(2, 8))),
        ],
    }
    fewer = {"state": {}, "param_groups": [dict(sd["param_groups"][0], params=[0, 1, 2])]}
    return [
        catch(opt.load_state_dict, d) for d in (two_groups, fewer, other.state_dict(), {"nope": 1})
    ]


def test_load_state_dict_errors_name_group_index_and_shape(pool):
    groups, count, shape, junk = pool.run(bad_load_task, world_size=2)[0]
    assert groups[0] == "ValueError" and "2 param groups" in groups[1]
    assert count[0] == "ValueError" and "group 0" in count[1] and "3 params" in count[1]
    assert (
        shape[0] == "ValueError"
        and "state[0]['exp_avg'] has shape (9, 7) but parameter 0 has shape (8, 6)" in shape[1]
    )
    assert junk[0] == "ValueError" and "'state' and 'param_groups'" in junk[1]


# ------------------------------------------------------------------ bad input
def mismatch_task(ctx):
    model = make_model(width=6 if ctx.rank == 0 else 7)
    return catch(OSS, model.parameters(), group=ctx.group, lr=0.1)


def test_different_models_raise_a_clear_error_on_every_rank(pool):
    results = pool.run(mismatch_task, world_size=3, timeout=30)
    for kind, message in results:
        assert kind == "ValueError"
        assert "hold different models" in message and "param 0 of group 0" in message


def one_rank_bad_input_task(ctx):
    params = [torch.zeros(2, requires_grad=True)] if ctx.rank else []
    return catch(OSS, params, group=ctx.group, lr=0.1)


def test_bad_input_on_one_rank_fails_every_rank_without_a_hang(pool):
    results = pool.run(one_rank_bad_input_task, world_size=2, timeout=30)
    assert results[0][0] == "ValueError" and "empty parameter list" in results[0][1]
    assert results[1][0] == "ValueError" and "global rank(s) [0]" in results[1][1]
    assert results[0][1] in results[1][1]  # the peer names rank 0's own error


def bad_input_task(ctx):
    p = torch.nn.Parameter(torch.zeros(3))
    cases = {
        "empty": ([], {}),
        "non_tensor": ([p, 1.0], {}),
        "sparse": ([torch.zeros(2, 2).to_sparse().requires_grad_()], {}),
        "twice": ([p, p], {}),
        "optim_not_class": ([p], {"optim": torch.nn.Linear}),
        "optim_instance": (
            [p],
            {"optim": torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1)},
        ),
        "bad_wire": ([p], {"broadcast_dtype": torch.int8}),
    }
    return {
        k: catch(OSS, params, group=ctx.group, lr=0.1, **kw) for k, (params, kw) in cases.items()
    }


def test_bad_input_raises_clear_errors(pool):
    for result in pool.run(bad_input_task, world_size=2):
        assert result["empty"][0] == "ValueError"
        assert result["non_tensor"][0] == "TypeError" and "float" in result["non_tensor"][1]
        assert result["sparse"][0] == "ValueError" and "sparse" in result["sparse"][1]
        assert result["twice"][0] == "ValueError" and "same tensor" in result["twice"][1]
        assert (
            result["optim_not_class"][0] == "TypeError" and "Linear" in result["optim_not_class"][1]
        )
        assert (
            result["optim_instance"][0] == "TypeError" and "instance" in result["optim_instance"][1]
        )
        assert result["bad_wire"][0] == "ValueError" and "broadcast_dtype" in result["bad_wire"][1]


def test_no_process_group_gives_a_clear_error():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        OSS([torch.nn.Parameter(torch.zeros(1))], lr=0.1)


def default_group_task(ctx):
    model = make_model()
    ref_model = clone_model(model)
    opt = OSS(model.parameters(), lr=0.1)  # group=None -> WORLD
    train(model, opt, 2)
    train(ref_model, torch.optim.SGD(ref_model.parameters(), lr=0.1), 2)
    return opt.world_size, params_equal(model, ref_model)


def test_group_none_means_world(pool):
    for world_size, exact in pool.run(default_group_task, world_size=4):
        assert world_size == 4
        assert exact, "differs from plain SGD"


def _holds_tensor(obj):
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, dict):
        return any(_holds_tensor(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_holds_tensor(v) for v in obj)
    return False


def no_pickled_tensors_task(ctx, recipient):
    """Record what consolidation sends as objects, and the bytes this rank's shard server
    hands over (the recipient reads the others' shards alone: issue 56)."""
    from oss_plus.state import serve

    model = make_model()
    opt = OSS(model.parameters(), optim=torch.optim.Adam, group=ctx.group, lr=0.01)
    train(model, opt, 2)
    objects, sent = [], [0]
    real_gather, real_chunks = dist.all_gather_object, serve.shard_chunks

    def gather_object(out, obj, group=None):
        objects.append(obj)
        return real_gather(out, obj, group=group)

    def chunks(tensors, *args):
        for chunk in real_chunks(tensors, *args):
            sent[0] += len(chunk)
            yield chunk

    dist.all_gather_object, serve.shard_chunks = gather_object, chunks
    try:
        # every rank counts before any read goes out: a server answers as soon as a request
        # arrives, so a rank still patching would serve uncounted
        dist.barrier(group=ctx.group)
        opt.consolidate_state_dict(recipient_rank=recipient)
        dist.barrier(group=ctx.group)
    finally:
        dist.all_gather_object, serve.shard_chunks = real_gather, real_chunks
    state_bytes = sum(
        v.numel() * v.element_size()
        for s in opt.optim.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )
    return any(_holds_tensor(o) for o in objects), sent[0], state_bytes


def test_consolidation_pickles_no_tensor_and_only_the_recipient_receives(pool):
    results = pool.run(no_pickled_tensors_task, 1, world_size=3)
    for rank, (pickled_tensor, sent, own_state) in enumerate(results):
        assert not pickled_tensor
        # each other rank hands over exactly its own state, once; the recipient nothing
        assert sent == (0 if rank == 1 else own_state)


def _inner_order(ctx, adapter):
    from oss_plus.compat.fairscale import OSS as FairscaleOSS

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.Linear(8, 16), torch.nn.Linear(16, 2)
    )
    cls = FairscaleOSS if adapter else OSS
    opt = cls(model.parameters(), optim=torch.optim.Adam, lr=0.1, group=ctx.group)
    flat = list(model.parameters())
    index = {id(p): i for i, p in enumerate(flat)}
    inner = [index[id(p)] for g in opt.optim.param_groups for p in g["params"]]
    listed = [index[id(p)] for p in opt.partition_parameters()[ctx.rank][0]["params"]]
    return inner, listed, [flat[i].numel() for i in inner]


@pytest.mark.parametrize("adapter", [False, True], ids=["core", "fairscale_adapter"])
def test_inner_optimizer_steps_largest_params_first_fairscale_adapter_keeps_order(pool, adapter):
    for inner, listed, sizes in pool.run(_inner_order, adapter, world_size=2):
        assert inner == listed  # partition_parameters lists what the inner optimizer steps
        if adapter:
            assert inner == sorted(inner)  # fairscale's order: as given
        else:
            assert sizes == sorted(sizes, reverse=True) and inner != sorted(inner)
