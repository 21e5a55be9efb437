"""The panels' controls: the anchor policy's form (:func:`anchor_policy_controls`) and a role's Start / Stop
(:func:`role_controls`), each behind the panel's login (:func:`~.access.guarded`)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import BucketError
from ..protocol import AnchorPolicy
from ..protocol.policy import policy_names
from .access import CONTROL_EVENT, guarded
from .anchor_policy import current_policy, describe_policy, make_policy, setting_fields, write_policy
from .live import Live, live_for
from .role_control import RoleRunner
from .snapshots import BucketSource, Snapshot, bucket_view, redact

logger = logging.getLogger(__name__)


def anchor_policy_controls(
    source: BucketSource | Live, default: AnchorPolicy | None = None, prefix: str = ""
) -> dict[str, Any]:
    """Controls of the anchor policy, built from the policy registry: the policy's name, one number
    per setting of any registered policy (:func:`~rlsync.spaces.anchor_policy.setting_fields`), Apply.

    Apply writes the bucket's control object (:func:`~rlsync.protocol.policy_to_json`);
    the trainer, wherever it runs, uses it from its next publish. The inputs are
    filled from the control object when the page loads (not on every refresh,
    which would overwrite what the user is typing); the line above them shows
    the policy in force and refreshes.

    Args:
        source: A bucket URL (or a function returning it), or a :class:`Live` to refresh with.
        default: The policy to show while the bucket has no control object.
        prefix: Prepended to the components' ``elem_id`` (``<prefix>anchor-policy``,
            ``<prefix>anchor-<setting>``, ...).

    Returns:
        ``{"current", "policy", "apply", "result", "settings"}`` components; ``settings`` maps each
        setting's name to its input.
    """
    import gradio as gr

    live, own = live_for(source)
    info = current_policy(Snapshot(), default)
    fields = setting_fields()
    current = gr.Markdown(describe_policy(info), elem_id=f"{prefix}anchor-policy-current")
    with gr.Row():
        policy = gr.Radio(policy_names(), value=info["policy"], label="Anchor policy", elem_id=f"{prefix}anchor-policy")
        inputs = {
            f.name: gr.Number(
                info[f.name], precision=0 if f.type in (int, "int") else None, minimum=f.metadata.get("minimum"),
                step=f.metadata.get("step", 1), label=f.metadata.get("label", f.name),
                elem_id=f"{prefix}anchor-{f.name.replace('_', '-')}",
            )  # fmt: skip
            for f in fields
        }
        apply = gr.Button("Apply", variant="primary", elem_id=f"{prefix}anchor-apply")
    result = gr.Markdown("", elem_id=f"{prefix}anchor-result")

    def on_apply(kind: str, *values: float | None) -> str:
        try:
            new = make_policy(kind, dict(zip(inputs, values)))
            write_policy(bucket_view(live.source).open(create=True), new)
        except (ValueError, BucketError) as exc:
            logger.warning("anchor policy not applied: %s", redact(str(exc)))
            return redact(f":x: not applied: {exc}")
        return f"Applied `{json.dumps(new.settings())}`: takes effect at the next publish."

    def on_load() -> tuple[Any, ...]:
        got = current_policy(bucket_view(live.source).snapshot(), default)
        return (got["policy"], *(got[name] for name in inputs))

    apply.click(
        guarded(on_apply, lambda why: f":no_entry: not applied: {why}"), inputs=[policy, *inputs.values()],
        outputs=result, api_name=f"{prefix}apply_anchor_policy".replace("-", "_"), **CONTROL_EVENT,
    )  # fmt: skip
    live.add(current, lambda view, snap: describe_policy(current_policy(snap, default)))
    root = gr.context.Context.root_block
    if root is not None:
        root.load(on_load, outputs=[policy, *inputs.values()], show_progress="hidden")
    if own:
        live.attach()
    return {
        "current": current,
        "policy": policy,
        "settings": inputs,
        "apply": apply,
        "result": result,
    }


def role_controls(
    runner: RoleRunner,
    make_config: Callable[..., Any],
    inputs: Sequence[Any],
    live: Live,
    on_started: Callable[[Any], None] | None = None,
    prefix: str = "",
) -> dict[str, Any]:
    """Start / Stop buttons, the role's status line (refreshed) and the last action's result (a refusal or an
    invalid setting stays shown until the next Start or Stop, which the refresh does not overwrite).

    Args:
        runner: The role this panel hosts.
        make_config: ``make_config(*form values) -> config`` (may raise ``ValueError``).
        inputs: The form components passed to ``make_config``.
        live: Refreshes the status line.
        on_started: Called with the config when Start is pressed (e.g. to follow its bucket).
        prefix: Prepended to the components' ``elem_id`` (``<prefix>start-<name>``, ...).

    Returns:
        ``{"start", "stop", "status", "result"}`` components.
    """
    import gradio as gr

    name = runner.name
    with gr.Row():
        start = gr.Button(f"Start {name}", variant="primary", elem_id=f"{prefix}start-{name}")
        stop = gr.Button(f"Stop {name}", variant="stop", elem_id=f"{prefix}stop-{name}")
    status = gr.Markdown(runner.status(), elem_id=f"{prefix}status-{name}")
    result = gr.Markdown("", elem_id=f"{prefix}result-{name}")

    def on_start(*values: Any) -> str:
        try:
            config = make_config(*values)
        except (ValueError, TypeError) as exc:
            return f"**{name}**: invalid settings: {redact(str(exc))}"
        if on_started is not None:
            on_started(config)
        return runner.start(config)

    start.click(
        guarded(on_start, lambda why: f":no_entry: **{name}**: not started: {why}"), inputs=list(inputs),
        outputs=result, api_name=f"{prefix}start_{name}".replace("-", "_"), **CONTROL_EVENT,
    )  # fmt: skip
    stop.click(
        guarded(lambda: runner.stop(wait=False), lambda why: f":no_entry: **{name}**: not stopped: {why}"),
        outputs=result, api_name=f"{prefix}stop_{name}".replace("-", "_"), **CONTROL_EVENT,
    )  # fmt: skip
    live.add(status, lambda view, snap: runner.status())
    return {"start": start, "stop": stop, "status": status, "result": result}
