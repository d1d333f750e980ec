r"""``muonfn.optim``: a ``torch.optim.Optimizer`` that steps with the functional core.

:class:`Muon` keeps the ``torch.optim`` contract (``param_groups``, ``state``, ``step``,
``state_dict``) and translates it: each param group into a preset's branch, run by
``Transform.update``, and its parameters' state into that branch's TensorDict.

**Groups.** Every group is routed wholly to Muon or to AdamW (``"use_muon"``). A group given
without it is split by ``labels`` (default :func:`muonfn.label_params`) into a Muon and an AdamW
group, both kept even when empty. A Muon group holds Muon's settings (``variant`` and its
options, torch.optim.Muon's ``ns_coefficients``, ``ns_steps``, ``eps``, ``adjust_lr_fn``, the other
``ns_*`` entries), an AdamW group AdamW's (its β₁ as ``momentum``, β₂ as ``beta2``, so that
schedulers cycling momentum cycle both). A setting changed in ``param_groups`` acts at the next
step; ``lr``, ``momentum`` and ``weight_decay`` are refilled into 0-d tensors, recompiling nothing.

**State.** As torch's: ``opt.state[p]`` is a plain dict under torch's names (``momentum_buffer``;
``step``, ``exp_avg``, ``exp_avg_sq``; the variants' second moments), made at the parameter's first
gradient on its device and in its dtype, so frozen parameters hold none, and ``opt.state =
collections.defaultdict(dict)`` resets. What is written there is what the next step continues
from, checked before anything changes. ``opt.functional_state`` is the same tensors laid out as
``muonfn.muon(...).init`` lays them out; ``state_dict()`` is torch's format,
``load_torch_state_dicts`` / ``torch_state_dicts`` migrate from and to ``torch.optim.Muon`` +
``torch.optim.AdamW``.

Example::

    opt = muonfn.optim.Muon(model.named_parameters(), lr=3e-4)  # AdamW's rate, for both groups
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)
    for x, y in loader:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
        scheduler.step()

See the shim's page in the docs for the whole contract.
"""

from ._optimizer import Muon

__all__ = ["Muon"]
