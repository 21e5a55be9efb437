"""All three roles in one process with one combined panel: ``python app.py``.

By default this starts, on the embedded setup (a local folder bucket
``./runs/bucket``, the tiny offline model, CPU), one environment, two rollout
replicas and one trainer, and serves a panel with an Overview tab (reward,
published sizes, fleet) and one tab per role (the same panels as the three
Spaces' ``app.py``, with their Start / Stop buttons and the anchor policy
controls). Within a few minutes the plots move: versions are published as
anchors and deltas, replicas follow them, and the mean reward per version is
plotted.

Flags::

    --bucket URL        bucket (default $RLSYNC_BUCKET or ./runs/bucket; hf://buckets/OWNER/NAME works)
    --replicas N        rollout replicas in this process (default 2)
    --port P            panel port (default $PORT or 7860)
    --host HOST         panel address (default $GRADIO_SERVER_NAME or 127.0.0.1; elsewhere, controls need PANEL_AUTH)
    --no-autostart      start nothing until Start is pressed in the panel
    --fresh             delete the bucket's run objects first (weights, tasks, scores, status, metrics)
    --environment NAME  environment of the env role (default: ENV_ENVIRONMENT or "reverse")
    --max-steps N       stop the trainer after N optimizer steps (default: TRAINER_MAX_STEPS or never)
    --lora              train a LoRA adapter (rank TRAINER_LORA_RANK, default 8) and serve its versions
                        from the bucket's adapter chain (docs/lora.md)
    --model NAME        the trainer's and replicas' model: a folder, a Hub id, or tiny-moe for the tiny
                        offline MoE (docs/moe.md) (default: TRAINER_MODEL / ROLLOUT_MODEL or the tiny model)

Every other setting comes from the roles' environment variables
(``TRAINER_*``, ``ROLLOUT_*``, ``ENV_*``, see each Space's README). "Start all"
on the Overview tab starts the roles with these settings; a role tab's Start
uses that tab's form. The panel's access is the Spaces' (``rlsync.spaces.access``): bound to
127.0.0.1 unless told, its controls need the ``PANEL_AUTH`` login when reachable by others.
SIGTERM or Ctrl-C stops the roles cleanly.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import signal
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from env_space.config import EnvConfig
from rlsync.config import process_settings
from rlsync.spaces.settings import server_port
from rollout_space.config import ReplicaConfig
from trainer_space.config import TrainerConfig

if TYPE_CHECKING:  # the roles, gradio and torch are imported once the flags are read: --help stays fast
    import gradio as gr

    from rlsync.bucket import Bucket
    from rlsync.spaces import role_control, snapshots

logger = logging.getLogger("app")

DEFAULT_BUCKET = "./runs/bucket"
#: LoRA rank of ``--lora`` when ``TRAINER_LORA_RANK`` does not set one.
DEFAULT_LORA_RANK = 8
PROGRESS_EVERY_S = 20.0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--bucket", default=process_settings().bucket or DEFAULT_BUCKET, help="bucket URL or folder"
    )
    parser.add_argument("--replicas", type=int, default=2, help="rollout replicas in this process")
    parser.add_argument(
        "--port", type=int, default=server_port()
    )
    parser.add_argument(
        "--host", default=None, help="panel address (default $GRADIO_SERVER_NAME or 127.0.0.1)"
    )
    parser.add_argument(
        "--no-autostart", dest="autostart", action="store_false", help="start the roles from the panel only"
    )
    parser.add_argument("--fresh", action="store_true", help="delete the bucket's run objects first")
    parser.add_argument("--environment", default=None, help="environment name (default from ENV_ENVIRONMENT)")
    parser.add_argument("--max-steps", type=int, default=None, help="trainer optimizer steps (0: never stop)")
    parser.add_argument("--lora", action="store_true", help="train and serve a LoRA adapter (docs/lora.md)")
    parser.add_argument("--model", default=None, help="model of the trainer and the replicas (tiny-moe: the tiny MoE, docs/moe.md)")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    if args.replicas < 1:
        parser.error("--replicas must be at least 1")
    return args


def run_prefixes() -> tuple[str, ...]:
    """Keys and key prefixes of one run's objects, deleted by ``--fresh`` (nothing else in the folder is touched)."""
    from rlsync.layout import (
        ADAPTER_PREFIX,
        ANCHOR_PREFIX,
        CHECKPOINTS_PREFIX,
        CLAIMS_PREFIX,
        CONTROL_PREFIX,
        DELTA_PREFIX,
        LOCK_KEY,
        METRICS_PREFIX,
        POINTER_KEY,
        ROLLOUTS_PREFIX,
        SCORES_PREFIX,
        STATUS_PREFIX,
        TASKS_PREFIX,
    )

    return (
        POINTER_KEY, LOCK_KEY, ANCHOR_PREFIX, DELTA_PREFIX, CONTROL_PREFIX, STATUS_PREFIX,
        METRICS_PREFIX, TASKS_PREFIX, ROLLOUTS_PREFIX, SCORES_PREFIX, CLAIMS_PREFIX, CHECKPOINTS_PREFIX, ADAPTER_PREFIX,
    )  # fmt: skip


def clear_run(bucket: Bucket) -> int:
    """Delete a run's objects (:func:`run_prefixes`) from ``bucket``; returns how many."""
    prefixes = run_prefixes()
    keys = [o.key for o in bucket.list() if o.key.startswith(prefixes)]
    if keys:
        bucket.delete(keys)
    logger.info("fresh start: deleted %d objects from %s", len(keys), bucket.url)
    return len(keys)


class Stack:
    """The three roles' runners and configs of the combined app.

    Args:
        bucket: Bucket URL shared by the roles.
        replicas: Rollout replicas.
        environment: Environment name (``None``: from ``ENV_ENVIRONMENT``).
        max_steps: Trainer step limit (``None``: from ``TRAINER_MAX_STEPS``).
        lora: Train a LoRA adapter (``TRAINER_LORA_RANK``, default :data:`DEFAULT_LORA_RANK`) and serve its versions.
        model: The trainer's and the replicas' model (``None``: from ``TRAINER_MODEL`` and ``ROLLOUT_MODEL``).
    """

    def __init__(
        self, bucket: str, replicas: int, environment: str | None = None, max_steps: int | None = None, lora: bool = False,
        model: str | None = None,
    ) -> None:
        from env_space import app as env_app
        from rollout_space import app as rollout_app
        from trainer_space import app as trainer_app

        self.bucket = bucket
        self.trainer_config = TrainerConfig.from_env(bucket=bucket, max_steps=max_steps, model=model)
        if lora and not self.trainer_config.lora_rank:
            self.trainer_config = dataclasses.replace(self.trainer_config, lora_rank=DEFAULT_LORA_RANK)
        self.env_config = EnvConfig.from_env(bucket=bucket, environment=environment)
        rollout = ReplicaConfig.from_env(bucket=bucket, model=model, replicas=replicas, **({"lora": True} if lora else {}))
        self.replica_config = dataclasses.replace(rollout, replica_id=rollout.replica_id or "replica")
        self.trainer = trainer_app.make_runner()
        self.env = env_app.make_runner()
        self.rollout = rollout_app.make_runner()

    @property
    def runners(self) -> list[role_control.RoleRunner]:
        return [self.trainer, self.env, self.rollout]

    def start_all(self) -> str:
        """Start every role that is not running, with the default settings."""
        logger.info("starting trainer, env and %d replica(s) on %s", self.replica_config.replicas, self.bucket)
        self.trainer.start(self.trainer_config)
        self.env.start(self.env_config)
        self.rollout.start(self.replica_config)
        return self.status()

    def stop_all(self, wait: bool = True) -> str:
        """Stop every role (replicas and env first, then the trainer).

        Args:
            wait: Wait until they stopped (otherwise they stop in background threads).
        """
        for runner in (self.rollout, self.env, self.trainer):
            runner.stop(wait=wait)
        return self.status()

    def status(self) -> str:
        return " · ".join(r.status() for r in self.runners)


def progress_line(snap: snapshots.Snapshot) -> str:
    """One log line of the run's progress, from a bucket snapshot."""
    from rlsync.spaces import frames

    parts = []
    if snap.manifest is not None:
        pubs = frames.publish_frame(snap)
        anchors = int((pubs["kind"] == "anchor").sum())
        parts.append(f"version {snap.manifest.step} ({anchors} anchors, {len(pubs) - anchors} deltas published)")
        deltas = pubs[pubs["kind"] == "delta"]
        if len(deltas):
            parts.append(f"last delta {deltas['KB'].iloc[-1]:.0f} KB ({deltas['changed_pct'].iloc[-1]:.1f}% changed)")
    else:
        parts.append("nothing published yet")
    rewards = frames.reward_frame(snap)
    env = rewards[rewards["source"] == "env"]
    if len(env):
        head, tail = env.head(10), env.tail(10)
        parts.append(
            f"env mean reward {head['mean_reward'].mean():.3f} (v{head['version'].min()}-{head['version'].max()})"
            f" -> {tail['mean_reward'].mean():.3f} (v{tail['version'].min()}-{tail['version'].max()})"
        )
    for st in snap.statuses:
        parts.append(f"{st.replica_id} at v{st.applied_step} (lag {st.lag})")
    return "; ".join(parts)


def log_progress(stack: Stack, stop: threading.Event, every: float = PROGRESS_EVERY_S) -> None:
    """Log :func:`progress_line` every ``every`` seconds while any role runs."""
    from rlsync.spaces import snapshots

    view = snapshots.bucket_view(stack.bucket)
    hinted = False
    while not stop.wait(every):
        if not hinted and (hint := fresh_hint(stack)):
            logger.warning(hint)
            hinted = True
        if any(r.running for r in stack.runners):
            logger.info("progress: %s", progress_line(view.snapshot()))


def fresh_hint(stack: Stack) -> str | None:
    """What to do when the trainer refused the bucket's run (a run with no checkpoint to resume from)."""
    if "RunExistsError" not in stack.trainer.error:
        return None
    return (
        f"the trainer refused the run already in {stack.bucket}: `python app.py --fresh` deletes its objects "
        "and starts a new run (or use another --bucket)"
    )


def build_app(stack: Stack) -> gr.Blocks:
    """The combined panel: an Overview tab and one tab per role, all reading ``stack.bucket``.

    Each tab has its own refresh timer, active only while the tab is selected.
    """
    import gradio as gr

    from env_space import app as env_app
    from rlsync.roles import Role
    from rlsync.spaces import access, frames
    from rlsync.spaces.live import REFRESH_S, Live
    from rlsync.spaces.plots import apply_plot, fleet_lag_plot, ratio_plot, reward_plot, size_plot, staleness_plot
    from rlsync.spaces.tables import fleet_table, summary_line
    from rlsync.spaces.role_panel import PanelPlace
    from rollout_space import app as rollout_app
    from trainer_space import app as trainer_app

    url = stack.bucket
    names = ["overview", *Role]
    with gr.Blocks(title="RL Sync: async RL weight sync") as demo:
        gr.Markdown(
            "# RL Sync: asynchronous RL weight sync\n"
            "A trainer publishes bf16 weights to the bucket as full **anchors** and sparse **deltas**; "
            "rollout replicas follow them bit-exactly; an environment hands out tasks and scores completions. "
            f"Bucket: `{url}`."
        )
        timers = {name: gr.Timer(REFRESH_S, active=(name == "overview")) for name in names}
        with gr.Tabs():
            with gr.Tab("Overview", id="overview", elem_id="tab-overview") as overview:
                with gr.Row():
                    start = gr.Button("Start all", variant="primary", elem_id="start-all")
                    stop = gr.Button("Stop all", variant="stop", elem_id="stop-all")
                status = gr.Markdown(stack.status(), elem_id="overview-status")
                start.click(
                    access.guarded(stack.start_all, lambda why: f"not started: {why}"), outputs=status, api_name="start_all",
                    **access.CONTROL_EVENT,
                )
                stop.click(
                    access.guarded(lambda: stack.stop_all(wait=False), lambda why: f"not stopped: {why}"),
                    outputs=status, api_name="stop_all", **access.CONTROL_EVENT,
                )  # fmt: skip
                with Live(url, timers["overview"]) as live:
                    live.add(status, lambda view, snap: stack.status())
                    summary_line(live, frames.trainer_summary, elem_id="overview-trainer-summary")
                    summary_line(live, frames.env_summary, elem_id="overview-env-summary")
                    summary_line(live, frames.flow_summary, elem_id="overview-flow-summary")
                    summary_line(live, frames.adapter_summary, elem_id="overview-adapter-summary")
                    summary_line(live, frames.hub_requests_summary, elem_id="overview-hub-requests")
                    with gr.Row():
                        reward_plot(live, prefix="overview-")
                        size_plot(live, prefix="overview-")
                    with gr.Row():
                        ratio_plot(live, prefix="overview-")
                        staleness_plot(live, prefix="overview-")
                    with gr.Row():
                        fleet_lag_plot(live, prefix="overview-")
                        apply_plot(live, prefix="overview-")
                    fleet_table(live, prefix="overview-")
            with gr.Tab("Trainer", id="trainer", elem_id="tab-trainer") as trainer_tab:
                trainer_app.build_panel(
                    stack.trainer, stack.trainer_config, PanelPlace(url, timers[Role.TRAINER], "trainer-")
                )
            with gr.Tab("Rollout", id="rollout", elem_id="tab-rollout") as rollout_tab:
                place = PanelPlace(url, timers[Role.ROLLOUT], "rollout-")
                rollout_app.build_panel(stack.rollout, stack.replica_config, place)
            with gr.Tab("Environment", id="env", elem_id="tab-env") as env_tab:
                env_app.build_panel(stack.env, stack.env_config, PanelPlace(url, timers[Role.ENV], "env-"))
        for name, tab in zip(names, (overview, trainer_tab, rollout_tab, env_tab)):
            tab.select(
                lambda shown=name: [gr.Timer(active=(other == shown)) for other in names],
                outputs=[timers[n] for n in names],
                show_progress="hidden",
            )
    return demo


def _interrupt(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    from rlsync.bucket import BucketSettings, open_bucket
    from rlsync.bucket.settings import role_weight
    from rlsync.roles import Role
    from rlsync.spaces.page import launch_options
    from rlsync.supervised import SupervisedThread

    # The roles and the panel share the token's Hub budget: each paces itself to its weight's part of the
    # total (the env, the panel and each replica weigh 1, the trainer more: its publishes are the product).
    os.environ.setdefault("HUB_SHARE", str(args.replicas + 2 + math.ceil(role_weight(Role.TRAINER))))
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "httpx2", "rlsync.protocol.subscriber"):  # httpx2: huggingface_hub's client, a line per request
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # "Loading weights" bars, one per model load
    stack = Stack(
        args.bucket, args.replicas, environment=args.environment, max_steps=args.max_steps, lora=args.lora, model=args.model
    )
    demo = build_app(stack)
    options: dict[str, Any] = {**launch_options(args.host), "server_port": args.port}
    demo.launch(prevent_thread_lock=True, **options)  # first, so a busy port stops us before any role runs
    logger.info(
        "panel on http://%s:%d",
        "localhost" if options["server_name"] in ("0.0.0.0", "::") else options["server_name"],
        args.port,
    )
    if args.fresh:
        clear_run(open_bucket(args.bucket, settings=BucketSettings.from_env()))
    if args.autostart:
        stack.start_all()
    else:
        logger.info("not starting the roles: press 'Start all' (or a tab's Start) in the panel")
    stop = threading.Event()
    SupervisedThread(log_progress, args=(stack, stop), name="progress", stop=stop).start()
    signal.signal(signal.SIGTERM, _interrupt)  # stop the roles cleanly on SIGTERM as on Ctrl-C
    try:
        demo.block_thread()
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        stop.set()
        logger.info("stopping the roles")
        stack.stop_all()
        demo.close()
        logger.info("stopped")


if __name__ == "__main__":
    main()
