"""``loco eval``: downstream tasks through lm-evaluation-harness, offline, on a tiny
multiple-choice task defined here (a task YAML over a local JSONL file)."""

import glob
import json
import os
import shutil
import types
from contextlib import nullcontext

# No network in the tests: the tiny task reads a local file; set before datasets is imported.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from loco import checkpoint, harness  # noqa: E402
from loco.cli import main  # noqa: E402

WORDS = "the king queen lord love death night day sword crown heart blood".split()
TASK = "loco_tiny_mc"


def train_args(corpus, out, *extra):
    text, cache = corpus
    return ["train", "--model", "tiny", "--workers", "2", "--sync-every", "4", "--seq-len", "32",
            "--batch-size", "4", "--vocab-size", "300", "--eval-every", "6", "--eval-batches", "2",
            "--final-eval-batches", "8", "--corpus", text, "--cache-dir", cache, "--out",
            str(out), "--no-progress", *extra]


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory):
    """A DiLoCo run, and a NoLoCo run whose replicas differ at the end (10 steps, H = 4)."""
    root = tmp_path_factory.mktemp("runs")
    assert main(train_args(corpus, root / "diloco", "--algorithm", "diloco", "--steps",
                           "12")) == 0
    assert main(train_args(corpus, root / "noloco", "--algorithm", "noloco", "--steps",
                           "10")) == 0
    return {"diloco": str(root / "diloco"), "noloco": str(root / "noloco")}


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    """A directory with one task: 8 three-way multiple-choice questions in a local JSONL."""
    import random

    d = tmp_path_factory.mktemp("tasks")
    rng = random.Random(1)
    with open(d / "tiny.jsonl", "w") as f:
        for i in range(8):
            f.write(json.dumps({"question": " ".join(rng.choice(WORDS) for _ in range(5)),
                                "choices": [" ".join(rng.choice(WORDS) for _ in range(3))
                                            for _ in range(3)],
                                "label": i % 3}) + "\n")
    (d / "tiny.yaml").write_text(f"""task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    validation: {d / "tiny.jsonl"}
output_type: multiple_choice
validation_split: validation
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
""")
    return str(d)


def summary(run_dir: str) -> dict:
    with open(os.path.join(run_dir, "summary.json")) as f:
        return json.load(f)


def one_line_error(argv, capsys, *words):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("loco eval: error: "), err
    for word in words:
        assert word in err[0], err


@pytest.mark.slow
def test_eval_writes_scores_summary_provenance_and_report(runs, tasks, tmp_path, capsys):
    run = shutil.copytree(runs["diloco"], tmp_path / "diloco")
    assert main(["eval", str(run), "--tasks", TASK, "--include-path", tasks]) == 0
    out = capsys.readouterr().out
    assert f"{TASK} (acc_norm)" in out and "final model" in out
    s = summary(str(run))
    scores = s["downstream"][TASK]
    assert 0 <= scores["acc"] <= 1 and 0 <= scores["acc_norm"] <= 1
    assert scores["samples"] == 8
    assert "downstream_replicas" not in s  # DiLoCo: the global model only, unless asked
    assert s["downstream_setup"]["final_model"] == "global"
    assert s["final_eval_loss"] is not None  # the rest of the summary is kept
    (provenance,) = glob.glob(str(run / "eval" / "*.json"))
    full = json.loads(open(provenance).read())
    assert full["configs"][TASK]["dataset_path"] == "json"
    assert full["models"]["final"]["results"][TASK]["acc,none"] == scores["acc"]
    assert os.path.relpath(provenance, run) == s["downstream_setup"]["results"]
    # the comparison report shows it
    assert main(["report", str(run)]) == 0
    report = (run / "report.md").read_text()
    assert "## Downstream tasks" in report and f"{TASK} (acc_norm, 8 docs)" in report
    assert "0-shot" in report and scores["shots"] == 0
    assert f"{scores['acc_norm']:.3f}" in report.split("## Downstream tasks")[1]
    compare = json.loads((run / "compare.json").read_text())
    assert compare["diloco"]["compare"]["downstream"][TASK] == {
        "metric": "acc_norm", "value": scores["acc_norm"]}


@pytest.mark.slow
def test_loaded_model_is_the_global_copy_and_reproduces_the_final_eval_loss(runs):
    from loco.data import eval_batches
    from loco.training import evaluate

    run = harness.open_run(runs["diloco"])
    tokenizer, corpus = harness.load_tokenizer(run)
    model = harness.replica_model(run, 0, corpus.vocab_size, global_copy=True)
    state = checkpoint.load_rank(runs["diloco"], run.step, 0)["algorithm"]
    (fragment,) = state["fragments"]  # DiLoCo: one fragment, the whole model
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert torch.equal(flat, fragment["global_params"])
    cfg = run.cfg
    batches = eval_batches(corpus.val, cfg.data.batch_size, cfg.data.seq_len, cfg.run.final_eval_batches,
                           torch.device("cpu"))
    loss = evaluate(model, dict(model.named_parameters()), batches, nullcontext())
    assert loss == pytest.approx(run.summary.final_eval_loss, rel=1e-6)


def direct_loglikelihood(model, context, continuation, max_length):
    """log P(continuation | context) and greedy-ness, one sequence through the model."""
    whole = (context + continuation)[-(max_length + 1):]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([whole[:-1]]))[0].double(), dim=-1)
    n = len(whole) - 1
    rows = logp[n - len(continuation):n]
    target = torch.tensor(continuation)
    return (rows[torch.arange(len(continuation)), target].sum().item(),
            bool((rows.argmax(-1) == target).all()))


@pytest.mark.slow
def test_loglikelihoods_equal_a_direct_computation_with_the_model(runs):
    run = harness.open_run(runs["diloco"])
    tokenizer, corpus = harness.load_tokenizer(run)
    model = harness.replica_model(run, 0, corpus.vocab_size, global_copy=True)
    max_length = run.cfg.data.seq_len
    lm = harness.make_lm(model, tokenizer, max_length, batch_size=3)
    long_context = " ".join(WORDS * 4)  # longer than the 32-token context: cut on the left
    pairs = [("the king", " is dead"), ("love", " the night"), ("sword and crown", " heart"),
             (long_context, " the queen"), ("day", " night night night"), ("", "the lord")]
    got = lm.loglikelihood([types.SimpleNamespace(args=p) for p in pairs], disable_tqdm=True)
    eot = lm.eot_token_id
    assert eot == tokenizer.token_to_id("<|endoftext|>")
    for (context, continuation), (ll, greedy) in zip(pairs, got):
        if context:
            ctx = tokenizer.encode(context).ids
            cont = tokenizer.encode(context + continuation).ids[len(ctx):]
        else:
            ctx, cont = [eot], tokenizer.encode(continuation).ids
        want, want_greedy = direct_loglikelihood(model, ctx, cont, max_length)
        assert ll == pytest.approx(want, abs=1e-5)
        assert greedy == want_greedy
    assert len(tokenizer.encode(long_context).ids) > max_length
    # a whole text (rolling windows; shorter than the context here): log P(text | <eot>)
    text = "the queen doth speak"
    ids = tokenizer.encode(text).ids
    (rolling,) = lm.loglikelihood_rolling([types.SimpleNamespace(args=(text,))],
                                          disable_tqdm=True)
    assert rolling == pytest.approx(direct_loglikelihood(model, [eot], ids, max_length)[0],
                                    abs=1e-5)
    # greedy generation: the argmax token, step by step
    ctx = tokenizer.encode("the king").ids
    tokens = []
    with torch.no_grad():
        for _ in range(3):
            tokens.append(int(model(torch.tensor([ctx + tokens]))[0, -1].argmax()))
    tokens = tokens[:tokens.index(eot)] if eot in tokens else tokens  # it stops there
    (text,) = lm.generate_until([types.SimpleNamespace(
        args=("the king", {"until": [], "max_gen_toks": 3}))], disable_tqdm=True)
    assert text == tokenizer.decode(tokens) and text


@pytest.mark.slow
def test_noloco_scores_every_replica_and_their_average(runs, tasks, tmp_path, capsys):
    from loco.data import eval_batches
    from loco.training import evaluate

    run_dir = shutil.copytree(runs["noloco"], tmp_path / "noloco")
    run = harness.open_run(str(run_dir))
    _, corpus = harness.load_tokenizer(run)
    cfg = run.cfg
    batches = list(eval_batches(corpus.val, cfg.data.batch_size, cfg.data.seq_len,
                                cfg.run.final_eval_batches, torch.device("cpu")))
    models = {keys: model for keys, _, model in harness.run_models(run, corpus.vocab_size,
                                                                   replicas=True)}
    assert list(models) == [("replica0", "final"), ("replica1",), ("average",)]
    replicas = [models[("replica0", "final")], models[("replica1",)]]
    first, second = (dict(m.named_parameters()) for m in replicas)
    assert any(not torch.equal(first[n], second[n]) for n in first)  # they differ
    for name, p in models[("average",)].named_parameters():
        torch.testing.assert_close(p, (first[name] + second[name]) / 2)
    losses = [evaluate(m, dict(m.named_parameters()), batches, nullcontext()) for m in replicas]
    assert losses == pytest.approx(run.summary.replicas["eval_losses"], rel=1e-6)

    assert main(["eval", str(run_dir), "--tasks", TASK, "--include-path", tasks]) == 0
    out = capsys.readouterr().out
    assert "replica 1" in out and "replicas' average" in out
    s = summary(str(run_dir))
    assert len(s["downstream_replicas"]) == 2
    assert s["downstream"] == s["downstream_replicas"][0]  # the final model is replica 0
    for entry in s["downstream_replicas"] + [s["downstream_average"]]:
        assert 0 <= entry[TASK]["acc"] <= 1 and entry[TASK]["samples"] == 8


def test_missing_run_directory_summary_or_checkpoint(tmp_path, capsys):
    one_line_error(["eval", str(tmp_path / "nope"), "--tasks", "piqa"], capsys,
                   "no such run directory")
    one_line_error(["eval", str(tmp_path), "--tasks", "piqa"], capsys, "no summary.json")
    (tmp_path / "summary.json").write_text(json.dumps({"algorithm": "diloco", "config": {}}))
    one_line_error(["eval", str(tmp_path), "--tasks", "piqa"], capsys, "no checkpoint")


@pytest.mark.slow
def test_unknown_task_and_unreadable_task_data(runs, tasks, tmp_path, capsys):
    one_line_error(["eval", runs["diloco"], "--tasks", "hellawsag", "--include-path", tasks],
                   capsys, "--tasks: unknown task 'hellawsag'", "did you mean hellaswag")
    broken = tmp_path / "broken"
    broken.mkdir()
    yaml = (open(os.path.join(tasks, "tiny.yaml")).read()
            .replace(TASK, "loco_broken").replace("tiny.jsonl", "missing.jsonl"))
    (broken / "broken.yaml").write_text(yaml)
    one_line_error(["eval", runs["diloco"], "--tasks", "loco_broken", "--include-path",
                    str(broken)], capsys, "loco_broken: its data could not be loaded",
                   "--include-path")
    assert "downstream" not in summary(runs["diloco"])
