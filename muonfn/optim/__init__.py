r"""``muonfn.optim``: a ``torch.optim.Optimizer`` that steps with the functional core.

:class:`Muon` translates between the ``torch.optim`` contract (``param_groups``,
``state``, ``step``, ``state_dict``) and ``muonfn``'s pure functions; every number it
writes comes from ``Transform.update``.

**Param groups.** Every group is routed wholly to Muon or to AdamW; its ``"use_muon"``
entry says which, and a Muon group's ``"variant"`` (``"muon"``, ``"normuon"``,
``"adamuon"``) its rule. A group given without ``"use_muon"`` (plain ``params``, or a dict
without the key) is split by ``labels`` into a Muon group followed by an AdamW group,
both kept even when empty, so ``Muon(model.named_parameters())`` has exactly two groups
and a scheduler scales both learning rates alike. Each group holds the settings that act on
it: a Muon group ``lr``, ``momentum``, ``weight_decay``, ``variant``, ``nesterov``,
``momentum_bias_correction``, ``cautious_weight_decay``, ``cautious_mode``, ``ns_*``,
``scale``, ``extra_scale`` and the variants' options (``ns=`` kept as the ``ns_*`` entries);
an AdamW group ``lr``, ``momentum`` (its beta1), ``beta2``, ``eps``, ``weight_decay``,
``nesterov`` and ``cautious_weight_decay``, which the constructor's ``adamw_*`` keywords set.
``lr``, ``momentum`` and ``weight_decay`` are read from ``param_groups`` at every step; the
others may be changed too and rebuild the transform. Schedulers that cycle momentum
(``OneCycleLR``, ``CyclicLR``) write ``momentum`` into every group, so they cycle Muon's
momentum and AdamW's beta1 alike, as they cycle ``torch.optim.AdamW``'s ``betas[0]``. A
group's parameters and its ``"use_muon"`` are fixed when it is added (an edit is refused by
the next step, naming the group and the parameter): add parameters with ``add_param_group``.

**Routing.** Parameters given without names are routed by shape alone (embeddings and heads
to Muon), and a run whose Muon groups hold nothing that trains is plain AdamW: the
constructor warns once of either (:class:`muonfn.RoutingWarning`), naming the remedy.

**Learning rate.** ``lr`` is the rate one would give AdamW: the default scale,
``"match_rms_adamw"``, gives every Muon update AdamW's RMS, so one rate serves both kinds of
group (``adamw_lr`` defaults to ``lr``). Keller Jordan's ``lr=0.02`` is for
``scale="original"``, torch.optim.Muon's default, with ``adamw_lr`` set apart; at the same
``lr`` the default update is 0.2·√max(A, B) times that one's (2.26× on a 128×128 matrix).

**State.** ``opt.functional_state`` is the TensorDict ``Transform.update`` takes and
returns. Parameters are keyed by their ``named_parameters()`` names split at dots
(``("0", "weight")``, as in ``TensorDict.from_module``), or by their position
(``("0",)``, ``("1",)``, ...) when given without names. The k-th Muon group keeps its state
under ``"muon"`` (k = 0) or ``f"muon_{k}"``, the k-th AdamW group under ``"adamw"`` or
``f"adamw_{k}"``, so for the default two groups the layout is that of
``muonfn.muon(...).init(params)``: ``state["muon", "momentum", *key]`` and
``state["adamw", "step" | "exp_avg" | "exp_avg_sq", *key]``. As in torch.optim, a
parameter's state is made at its first step, from the parameter as it is then (so a model
materialised from the meta device or cast after the optimizer was built trains as if built
first, and frozen parameters hold none); until then the parameter has no entries there, nor in
``opt.state`` or the state dict. ``opt.state[p]`` shows the
same tensors under torch's names: ``{"momentum_buffer"}`` for Muon (with ``"step"`` under
``momentum_bias_correction``; ``"row_second_moment"`` for NorMuon; ``"exp_avg_sq"``, and its
count with ``second_moment_bias_correction``, for AdaMuon: ``"step"``, or
``"second_moment_step"`` where the momentum's count is ``"step"``), ``{"step", "exp_avg",
"exp_avg_sq"}`` for AdamW (each count an exact int64). It is a live view: assigning an entry
(``opt.state[p]["momentum_buffer"] = t``, ``.update(...)``) replaces that tensor of the
functional state after checking its shape and dtype (making the state of a parameter that
has none); other names are an error. ``del opt.state[p]`` forgets a parameter's state, and
``opt.state = collections.defaultdict(dict)`` (torch's reset) every parameter's; each is made
anew at the parameter's next step. Keys of ``opt.state`` that are not parameters hold what
torch's would.

**Checkpoints.** ``opt.state_dict()`` follows torch's format (state keyed by parameter
index, hyperparameters in ``param_groups``) and loads with ``torch.load(weights_only=True)``;
``muonfn.save(opt.functional_state, path)`` stores the TensorDict itself.
``opt.load_torch_state_dicts(muon_sd, adamw_sd)`` continues a run of ``torch.optim.Muon``
with ``torch.optim.AdamW``, and ``opt.torch_state_dicts()`` hands one back to them (Muon
groups of ``variant="muon"`` only: torch's Muon keeps no second moment).

Example::

    opt = muonfn.optim.Muon(model.named_parameters(), lr=3e-4)  # AdamW's rate, for both groups
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)
    for x, y in loader:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
        scheduler.step()
"""

from ._optimizer import Muon

__all__ = ["Muon"]
