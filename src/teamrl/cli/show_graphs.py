"""``teamrl show``: sampled episodes drawn as the graphs they are (inline SVG written here: one node
per agent step, lane = agent, column = turn, an edge from every parent the step read), each step's
message, tool calls, reward/credit and policy version beside it, and the same episode as plain text.
Every string from the run folder goes through ``html.escape``; ids are generated here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from teamrl.cli.show_run import Run, Sample, esc, finite, fmt_num, pick_best_worst

if TYPE_CHECKING:
    from teamrl.protocol.trajectory import AgentStep, GraphTrajectory

MAX_TEXT = 4000  # characters of one message shown; the rest is counted, not dropped silently


def episode_text(traj: GraphTrajectory, width: int = 400) -> str:
    """One episode as plain text: each step with its agent, the steps it read, version and reward."""
    head = (
        f"episode {traj.episode_id} task {traj.task_id} ({traj.workflow}): team reward "
        f"{fmt_num(float(traj.reward))}"
    )
    lines = [head]
    for i, st in enumerate(traj.steps):
        read = ", ".join(f"#{int(p)} {traj.steps[int(p)].agent_id}" for p in st.parents)
        text = st.response_text.strip().replace("\n", "\n      ")
        if len(text) > width:
            text = text[:width] + f"... (+{len(text) - width} chars)"
        lines.append(
            f"  #{i} {st.agent_id} ({st.role}, turn {st.turn}, {st.adapter or 'base'} v{st.policy_version}) "
            f"reward {fmt_num(float(st.reward))}{f' <- read {read}' if read else ''}"
        )
        lines.append(f"      {text or '(empty)'}")
        for call in st.tool_calls:
            lines.append(f"      tool call: {str(call)[:width]}")
    return "\n".join(lines)


NODE_W, NODE_H, COL_GAP, LANE_GAP, PAD = 128, 50, 46, 26, 14


def _reward_fill(r: float, scale: float) -> str:
    """White at 0, towards green for positive and red for negative credit."""
    t = max(-1.0, min(1.0, r / scale)) if scale > 0 else 0.0
    if t >= 0:
        return f"rgb({int(255 - 120 * t)},{int(255 - 40 * t)},{int(255 - 120 * t)})"
    t = -t
    return f"rgb({int(255 - 20 * t)},{int(255 - 130 * t)},{int(255 - 130 * t)})"


def _clip(s: str, n: int) -> str:
    return s if len(s) <= n else s[: n - 1] + "…"


def graph_svg(traj: GraphTrajectory, uid: str, colors: dict[str, str]) -> str:
    """The episode DAG: lane (row) per agent, column per turn, edges from each step's parents."""
    steps = traj.steps
    lanes = {a: i for i, a in enumerate(traj.agents)}
    turns = sorted({s.turn for s in steps})
    col_x, pos, w, h = _graph_layout(steps, lanes, turns)
    scale = max((abs(finite(s.reward) or 0.0) for s in steps), default=0.0)
    out = [
        f'<svg class="graph" viewBox="0 0 {w} {h}" width="{w}" height="{h}" role="img" '
        f'aria-label="episode graph, {len(steps)} steps">',
        f'<defs><marker id="ah-{uid}" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
        'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#555"/></marker></defs>',
    ]
    for t in turns:
        out.append(
            f'<text x="{col_x[t] + NODE_W / 2}" y="{PAD + 6}" class="turn" text-anchor="middle">turn {t}</text>'
        )
    for a, lane in lanes.items():
        y = PAD + 16 + lane * (NODE_H + LANE_GAP) + NODE_H / 2 + 4
        out.append(
            f'<text x="{PAD}" y="{y}" class="lane" fill="{colors.get(a, "#333")}">{esc(_clip(a, 10))}</text>'
        )
    for i, s in enumerate(steps):
        cx, cy = pos[i]
        for p in s.parents.tolist():
            if not 0 <= p < len(steps):
                continue  # decode already rejects this; a report never crashes on it
            qx, qy = pos[p]
            out.append(_edge(qx, qy, cx, cy, uid, p, i))
    for i, s in enumerate(steps):
        out.append(_node(s, i, pos[i], uid, colors.get(s.agent_id, "#333"), scale))
    out.append("</svg>")
    return "".join(out)


def _graph_layout(
    steps: list[AgentStep], lanes: dict[str, int], turns: list[int]
) -> tuple[dict[int, float], list[tuple[float, float]], int, int]:
    """Each turn's column x, each step's box (top-left corner), and the SVG's width and height.
    Steps of one agent within one turn sit side by side in that turn's column."""
    slot: list[int] = []
    count: dict[tuple[int, str], int] = {}
    for s in steps:
        k = (s.turn, s.agent_id)
        slot.append(count.get(k, 0))
        count[k] = count.get(k, 0) + 1
    width_of = {t: max(c for (tt, _), c in count.items() if tt == t) for t in turns}
    col_x, x = {}, PAD + 70.0
    for t in turns:
        col_x[t] = x
        x += width_of[t] * (NODE_W + 12) - 12 + COL_GAP
    w = int(x - COL_GAP + PAD + 30)
    h = int(PAD * 2 + 16 + len(lanes) * (NODE_H + LANE_GAP) - LANE_GAP)
    pos = [
        (col_x[s.turn] + slot[i] * (NODE_W + 12), PAD + 16 + lanes[s.agent_id] * (NODE_H + LANE_GAP))
        for i, s in enumerate(steps)
    ]
    return col_x, pos, w, h


def _node(s: AgentStep, i: int, at: tuple[float, float], uid: str, color: str, scale: float) -> str:
    """One step's box, filled by its credit, linking to its card, with a tooltip and a tool badge."""
    x0, y0 = at
    r = finite(s.reward)
    n_tools = len(s.tool_calls)
    tools = f", {n_tools} tool call(s)" if n_tools else ""
    tip = (
        f"#{i} {s.agent_id} (role {s.role}) turn {s.turn}, policy v{s.policy_version} "
        f"[{s.adapter or 'base'}], credit {fmt_num(r) if r is not None else 'n/a'}, "
        f"finish {s.finish_reason}{tools}\n{_clip(s.response_text, 300)}"
    )
    badge = (
        f'<rect x="{x0 + NODE_W - 38:.1f}" y="{y0 + 4:.1f}" width="34" height="13" rx="3" class="tb"/>'
        f'<text x="{x0 + NODE_W - 21:.1f}" y="{y0 + 14:.1f}" class="tt" text-anchor="middle">'
        f"{'tool' if n_tools == 1 else f'{n_tools} tools'}</text>"
        if n_tools
        else ""
    )
    return (
        f'<a href="#{uid}-s{i}"><g class="node" data-step="{i}" data-agent="{esc(s.agent_id)}">'
        f"<title>{esc(tip)}</title>"
        f'<rect x="{x0:.1f}" y="{y0:.1f}" width="{NODE_W}" height="{NODE_H}" rx="7" '
        f'fill="{_reward_fill(r or 0.0, scale)}" stroke="{color}"/>'
        f'<text x="{x0 + 7:.1f}" y="{y0 + 15:.1f}" class="nt">#{i} {esc(_clip(s.agent_id, 9 if n_tools else 13))}</text>'
        f"{badge}"
        f'<text x="{x0 + 7:.1f}" y="{y0 + 30:.1f}" class="ns">v{s.policy_version} · '
        f"{'credit ' + esc(f'{r:.3g}') if r is not None else 'credit n/a'}</text>"
        f'<text x="{x0 + 7:.1f}" y="{y0 + 44:.1f}" class="nm">{esc(_clip(" ".join(s.response_text.split()), 20))}</text>'
        "</g></a>"
    )


def _edge(qx: float, qy: float, cx: float, cy: float, uid: str, p: int, i: int) -> str:
    """Parent at (qx, qy) -> child at (cx, cy), both top-left corners of a node box."""
    if abs(qx - cx) < 1:  # same column: straight down to the next lane, arc on the right otherwise
        lanes = abs(cy - qy) / (NODE_H + LANE_GAP)
        if cy > qy and lanes < 1.5:
            d = f"M{qx + NODE_W / 2:.1f},{qy + NODE_H:.1f} L{cx + NODE_W / 2:.1f},{cy - 1:.1f}"
        else:
            bx = qx + NODE_W + 14 + 10 * lanes
            d = (
                f"M{qx + NODE_W:.1f},{qy + NODE_H / 2:.1f} C{bx:.1f},{qy + NODE_H / 2:.1f} "
                f"{bx:.1f},{cy + NODE_H / 2:.1f} {cx + NODE_W + 1:.1f},{cy + NODE_H / 2:.1f}"
            )
    else:
        sx, sy, ex, ey = qx + NODE_W, qy + NODE_H / 2, cx - 1, cy + NODE_H / 2
        mx = (sx + ex) / 2
        d = f"M{sx:.1f},{sy:.1f} C{mx:.1f},{sy:.1f} {mx:.1f},{ey:.1f} {ex:.1f},{ey:.1f}"
    return f'<path class="edge" d="{d}" marker-end="url(#ah-{uid})" data-from="{p}" data-to="{i}"/>'


def _step_card(s: AgentStep, i: int, uid: str, color: str) -> str:
    r = finite(s.reward)
    lp = [float(x) for x in s.logprobs.tolist()] if len(s.logprobs) else []
    mean_lp = sum(lp) / len(lp) if lp else None
    took = s.t_end - s.t_start if s.t_end and s.t_start else None
    facts = [
        f"turn {s.turn}",
        f"<b>policy v{s.policy_version}</b>",
        f"adapter {esc(s.adapter or 'base')}",
        f"model {esc(s.model_id)}",
        f"<b>credit {esc(fmt_num(r)) if r is not None else 'n/a'}</b>",
        f"finish {esc(s.finish_reason)}",
        f"prompt {len(s.prompt_ids)} tok, response {len(s.response_ids)} tok",
    ]
    if mean_lp is not None:
        facts.append(f"mean logprob {esc(fmt_num(mean_lp))}")
    if took is not None and took >= 0:
        facts.append(f"{took:.2f} s")
    parents = s.parents.tolist()
    facts.append(
        "reads " + ", ".join(f'<a href="#{uid}-s{p}">#{p}</a>' for p in parents) if parents else "root"
    )
    text = s.response_text
    more = (
        f'<span class="cut">… {len(text) - MAX_TEXT} more characters not shown</span>'
        if len(text) > MAX_TEXT
        else ""
    )
    tools = "".join(
        f'<div class="tool"><b>tool {esc(t.name)}</b><pre>{esc(_clip(t.arguments, 1500))}</pre>'
        f'<div class="res">→</div><pre>{esc(_clip(t.result, 1500))}</pre></div>'
        for t in s.tool_calls
    )
    return (
        f'<div class="step" id="{uid}-s{i}" style="border-left-color:{color}">'
        f'<div class="sh"><b style="color:{color}">#{i} {esc(s.agent_id)}</b>'
        f"{' <span class=role>(' + esc(s.role) + ')</span>' if s.role != s.agent_id else ''} "
        f'<span class="facts">{" · ".join(facts)}</span></div>'
        f'<pre class="msg">{esc(text[:MAX_TEXT]) or "<i>(empty message)</i>"}</pre>{more}{tools}</div>'
    )


def episode_panel(sample: Sample, uid: str, label: str, colors: dict[str, str], cards: bool = True) -> str:
    t = sample.traj
    versions = sorted({s.policy_version for s in t.steps})
    vtxt = (
        (f"v{versions[0]}" if len(versions) == 1 else f"v{versions[0]}–v{versions[-1]}")
        if versions
        else "none"
    )
    credit: dict[str, float] = {}
    for s in t.steps:
        credit[s.agent_id] = credit.get(s.agent_id, 0.0) + (finite(s.reward) or 0.0)
    credit_txt = ", ".join(
        f'<span style="color:{colors.get(a, "#333")}">{esc(a)}</span> {esc(fmt_num(c))}'
        for a, c in credit.items()
    )
    tr = ", ".join(fmt_num(float(x)) for x in t.turn_rewards.tolist())
    meta = ", ".join(f"{esc(k)}={esc(_clip(str(v), 80))}" for k, v in sorted(t.metadata.items()))
    r = finite(t.reward)
    head = (
        f'<div class="eh"><span class="tag">{esc(label)}</span> <b>team reward {esc(fmt_num(r)) if r is not None else "n/a"}</b>'
        f" · sampled with {vtxt} · {len(t.steps)} steps, {len(t.agents)} agents, {t.num_tokens} tokens</div>"
        f'<div class="em">episode {esc(_clip(t.episode_id, 40))} · task {esc(_clip(t.task_id, 40))} · '
        f"workflow {esc(_clip(t.workflow, 40))} · group {esc(_clip(t.group_id, 40))} · file {esc(sample.file)}</div>"
        f'<div class="em">credit per agent: {credit_txt or "none"}'
        f"{' · turn rewards: ' + esc(tr) if tr else ''}{' · ' + meta if meta else ''}</div>"
    )
    body = f'<div class="gw">{graph_svg(t, uid, colors)}</div>'
    if cards:
        steps = "".join(_step_card(s, i, uid, colors.get(s.agent_id, "#333")) for i, s in enumerate(t.steps))
        body += f'<details class="steps" open><summary>messages and tool calls ({len(t.steps)} steps)</summary>{steps}</details>'
    return f'<section class="episode" id="{uid}">{head}{body}</section>'


def episodes(run: Run, k: int, recent: int, colors: dict[str, str]) -> str:
    if not run.samples:
        return '<p class="none">No sampled episodes to draw.</p>'
    best, worst, versions = pick_best_worst(run.samples, k, recent)
    vtxt = ", ".join(f"v{v}" for v in sorted(versions))
    out = [
        f"<h2>Best and worst episodes of the newest policy versions ({esc(vtxt)})</h2>",
        f'<p class="note">From the {run.sample_files_read} sample file(s) read ({run.sample_files_total} in samples/), '
        f"{len(run.samples)} distinct episodes; ranked by team reward, then summed credit. Node colour: the "
        "step's credit (green positive, red negative); border: the agent. Click a node for its message.</p>",
        '<div class="pairs">',
    ]
    for j in range(max(len(best), len(worst))):
        b = episode_panel(best[j], f"b{j}", f"best #{j + 1}", colors) if j < len(best) else "<div></div>"
        w = episode_panel(worst[j], f"w{j}", f"worst #{j + 1}", colors) if j < len(worst) else "<div></div>"
        out.append(f'<div class="pair">{b}{w}</div>')
    out.append("</div>")
    spread = [s for name in run.spread_files for s in [_median_of(run.samples, name)] if s is not None]
    if len(spread) > 1:
        out.append(
            "<h2>Episodes over training (median-reward episode of sample files spread over the run)</h2>"
        )
        out.append('<div class="spread">')
        out += [episode_panel(s, f"o{j}", f"{s.file}", colors, cards=False) for j, s in enumerate(spread)]
        out.append("</div>")
    return "".join(out)


def _median_of(samples: list[Sample], file: str) -> Sample | None:
    pool = sorted((s for s in samples if s.file == file), key=lambda s: s.key)
    return pool[len(pool) // 2] if pool else None
