"""Prepended to each docs/frameworks.md recipe by tests/test_frameworks.py: records what the
job got -- backend, this rank's CPUs, whether the stepped parameters are DDP-wrapped, every
training loss (the recipes compute it with ``torch.nn.MSELoss``) and a digest of the final
weights -- into ``$CPUDDP_FW_OUT/<rank>.json`` at exit."""


def _cpuddp_probe() -> None:
    import atexit
    import hashlib
    import json
    import os

    import torch

    import cpuddp
    from cpuddp import ddp_check

    rec: dict = {"losses": [], "pid": os.getpid()}
    params: list = []

    def on_loss(module, args, out):
        if isinstance(module, torch.nn.MSELoss) and torch.is_grad_enabled():
            rec["losses"].append(float(out.detach()))

    def on_step(optimizer, args, kwargs):
        if params:
            return
        record(optimizer)

    def record(optimizer):
        params.extend(p for g in optimizer.param_groups for p in g["params"])
        session = cpuddp.get_session()
        rec.update(
            rank=cpuddp.get_rank(), world=cpuddp.get_world_size(), cpus=sorted(os.sched_getaffinity(0)),
            backend=session.backend if session else None, torch_backend=str(torch.distributed.get_backend()),
            wrapped=ddp_check.unwrapped([id(p) for p in params], ddp_check._wrapped_parameter_ids()) == 0,
        )

    def dump():
        if not params:
            return
        flat = torch.cat([p.detach().reshape(-1).double() for p in params])
        rec["weights"] = hashlib.sha256(repr(flat.tolist()).encode()).hexdigest()  # no numpy needed
        with open(os.path.join(os.environ["CPUDDP_FW_OUT"], f"{rec['rank']}.json"), "w") as f:
            json.dump(rec, f)

    torch.nn.modules.module.register_module_forward_hook(on_loss)
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(on_step)
    atexit.register(dump)

    # IPEX's fused optimizer step (torch 2.8 + IPEX) bypasses the step hooks: record at prepare()
    prepare = cpuddp.prepare

    def recording_prepare(model, optimizer=None, *args, **kwargs):
        out = prepare(model, optimizer, *args, **kwargs)
        if optimizer is not None and not params:
            record(optimizer)
        return out

    cpuddp.prepare = recording_prepare


_cpuddp_probe()
