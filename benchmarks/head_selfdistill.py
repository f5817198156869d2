"""An EAGLE head trained on the model's own answers, then its acceptance beside n-gram lookup.

    PYTHONPATH=. python3 benchmarks/head_selfdistill.py --model FILE_OR_NAME \
        [--prompts 4096] [--generated 1024] [--gen-len 192] [--steps 2000] [--batch 16] \
        [--seq-len 512] [--out head.safetensors] [--json F]

1. Passages: prose paragraphs of this checkout's Markdown, of the installed Python
   packages' long descriptions and of Python's reference manual (pydoc_data), plus
   `--generated` paragraphs the model writes itself (a sampled answer to "Write a short
   paragraph about WORD." for words of its own vocabulary: a GPU machine's prose gave only
   174 paragraphs, and a head trained ~118 times over their transcripts memorized them, 1.2
   tokens per verification on unseen text). Each passage is
   wrapped in the bench's kinds of input-grounded asks (copy-edit a word, summarize, rewrite
   for a beginner), `--prompts` of them drawn, chat-templated.
2. The model answers them greedily (`generate`, batches of 128): the head learns what the
   model itself writes after such prompts, the text it will draft.
3. `train_draft.train` with windows at each transcript's start (prompt + answer: the features
   drafting reads), AdamW, `--steps` steps of `--batch` windows of `--seq-len` tokens.
   The asks of some passages are held out whole: the head's teacher-forced agreement with
   the model on their answers (its first draft's hit rate on unseen text) beside the same
   on transcripts it trained on.
4. `speculative_bench.acceptance` on the bench's held-out passage (not among the paragraphs:
   it lives in jaxinfer/speculative_bench.py), edit and summarize, K = 3 and 5, for the head
   and for n-gram lookup: tokens per verification, drafts accepted, the wall-time ratio (the
   same tokens as plain greedy, checked there).

Minutes on a GPU; a CPU run at the defaults takes hours (try --prompts 8 --generated 4
--steps 4). The training's passes over the data are printed: many more than a few fit the
transcripts, not the model.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import re
import sys
import time

import numpy as np


def _texts():
    """This checkout's Markdown, the installed packages' long descriptions and Python's own
    reference manual (pydoc_data's topics: ~0.5 MB of prose wherever Python is)."""
    import pydoc_data.topics

    files = sorted(glob.glob("*.md") + glob.glob("benchmarks/*.md"))
    for site in sys.path:
        files += sorted(glob.glob(os.path.join(site, "*.dist-info", "METADATA")))
    for f in files:
        try:
            yield open(f, encoding="utf-8", errors="replace").read()
        except OSError:
            continue
    yield from pydoc_data.topics.topics.values()


def paragraphs(limit: int, rng) -> list[str]:
    """Prose paragraphs of 50-140 words, mostly words, several sentences (no tables, lists,
    code or headings), shuffled."""
    out, seen = [], set()
    for text in _texts():
        for p in text.split("\n\n"):
            p = re.sub(r"\s+", " ", p).strip()
            words = p.split()
            prose = sum(bool(re.fullmatch(r"\(?[A-Za-z][a-z'-]*[.,;:!?)]*", w))
                        for w in words) > 0.75 * len(words) and p.count(". ") >= 2
            if 50 <= len(words) <= 140 and prose and p not in seen \
                    and not p.startswith(("|", "```", "#", "*", "-", "+", "..", ">")):
                seen.add(p)
                out.append(p)
    return [out[i] for i in rng.permutation(len(out))[:limit]]


def vocabulary_words(tokenizer, limit: int, rng) -> list[str]:
    """Up to `limit` distinct words of the model's vocabulary (single tokens of 5-12 lowercase
    letters), shuffled: topics for passages the model writes."""
    words = set()
    for i in range(tokenizer.vocab_size):
        w = tokenizer.decode([i]).strip()
        if 5 <= len(w) <= 12 and w.isascii() and w.isalpha() and w.islower():
            words.add(w)
    words = sorted(words)
    return [words[i] for i in rng.permutation(len(words))[:limit]]


def written_paragraphs(model, limit: int, rng, batch: int = 128):
    """Paragraphs the model writes, sampled (temperature 0.8, top-p 0.95), about `limit` words
    of its vocabulary: (those of 40-160 words, every transcript: prompt + answer ids)."""
    import jaxinfer
    from jaxinfer import prompts as prompts_lib

    topics = vocabulary_words(model.tokenizer, limit, rng)
    ids = prompts_lib.encode(model.tokenizer, [f"Write a short paragraph about {w}."
                                               for w in topics], True, model.config.vocab_size)
    sampling = jaxinfer.SamplingParams(temperature=0.8, top_p=0.95)
    out, chats = [], []
    for s in range(0, len(ids), batch):
        for i, c in zip(ids[s:s + batch], jaxinfer.generate(model, ids[s:s + batch],
                                                            max_new_tokens=160,
                                                            sampling=sampling, seed=s)):
            chats.append(i + c.token_ids)
            text = re.sub(r"\s+", " ", c.text).strip()
            if 40 <= len(text.split()) <= 160:
                out.append(text)
    return out, chats


def held_out_agreement(model, head, chats, prompt_lens, seq_len: int, batch: int = 16):
    """The head's top-1 agreement with the target on transcripts' answer tokens, teacher-forced
    as training measures it (its first draft's hit rate): row i drafts token i + 1, and the
    answer's first token is the target's own, so rows from the prompt's length on count."""
    import jax
    import jax.numpy as jnp

    from jaxinfer import train_draft
    from jaxinfer.generate import run_params

    params = run_params(model, model.plan)

    @jax.jit
    def drafted(tokens):  # [B, T] -> the head's and the target's next tokens [B, T]
        f, p = train_draft.target_features(params, tokens, model.plan)
        logits, _ = train_draft.teacher_forced(head.params, params, tokens,
                                               f.astype(jnp.float32), head.spec)
        return jnp.argmax(logits, -1), jnp.argmax(p, -1)

    hits = total = 0
    for s in range(0, len(chats), batch):
        group = [c[:seq_len] for c in chats[s:s + batch]]
        tokens = np.zeros((batch, seq_len), np.int32)
        for r, c in enumerate(group):
            tokens[r, :len(c)] = c
        d, w = map(np.asarray, drafted(jnp.asarray(tokens)))
        for r, (c, n) in enumerate(zip(group, prompt_lens[s:s + batch])):
            rows = np.arange(n, len(c) - 1)
            hits += int((d[r, rows] == w[r, rows]).sum())
            total += len(rows)
    return hits / max(total, 1)


def asks(paras: list[str], limit: int, rng) -> list[str]:
    """Up to `limit` of the paragraphs' three input-grounded asks each (shuffled)."""
    out = []
    for p in paras:
        words = re.findall(r"[a-z]{4,}", p.lower())
        w = max(set(words), key=words.count) if words else "the"
        out += [f"Copy the following passage exactly, but replace every occurrence of "
                f"\"{w}\" with \"{w.upper()}\". Output only the passage.\n\n{p}",
                f"Summarize the following passage in three sentences.\n\n{p}",
                f"Rewrite the following passage in plain words for a beginner.\n\n{p}"]
    return [out[i] for i in rng.permutation(len(out))[:limit]]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", type=int, default=4096)
    ap.add_argument("--generated", type=int, default=1024,
                    help="paragraphs the model writes (about words of its vocabulary)")
    ap.add_argument("--gen-len", type=int, default=192)
    ap.add_argument("--gen-batch", type=int, default=128, help="prompts per generate call")
    ap.add_argument("--ks", default="3,5", help="drafts per verification to measure")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--draft-vocab", type=int, default=32768,
                    help="the head's draft vocabulary (the data's most frequent tokens)")
    ap.add_argument("--out", default="head.safetensors")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import jaxinfer
    from jaxinfer import draft_head, prompts as prompts_lib, speculative_bench, train_draft

    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    model = jaxinfer.load(args.model)
    found = paragraphs(args.prompts, rng)
    written, chats = (written_paragraphs(model, args.generated, rng, args.gen_batch)
                      if args.generated else ([], []))
    # held out: every ask of some found passages (never trained on, nor their passage under
    # another ask), for the head's agreement on unseen text
    held_paras = found[len(found) - min(16, len(found) // 10):]
    texts = asks(found[:len(found) - len(held_paras)] + written, args.prompts, rng)
    held_texts = asks(held_paras, 3 * len(held_paras), rng)
    ids = prompts_lib.encode(model.tokenizer, texts + held_texts, True, model.config.vocab_size)
    asked = []
    for s in range(0, len(ids), args.gen_batch):
        outs = jaxinfer.generate(model, ids[s:s + args.gen_batch], max_new_tokens=args.gen_len)
        asked += [i + o.token_ids for i, o in zip(ids[s:s + args.gen_batch], outs)]
    held = len(held_texts)
    held_chats, held_lens = asked[len(texts):], [len(i) for i in ids[len(texts):]]
    chats += asked[:len(texts)]  # the written paragraphs' transcripts train too
    lens = [len(c) for c in chats]
    data = np.asarray([t for c in chats for t in c], np.int32)
    starts = np.cumsum([0] + lens[:-1])
    t_data = time.perf_counter() - t0
    passes = args.steps * args.batch * args.seq_len / len(data)
    print(f"{len(found)} paragraphs found, {len(written)} written; {len(texts)} prompts, "
          f"{len(chats)} transcripts, {len(data)} tokens (longest {max(lens)}) in "
          f"{t_data:.0f} s; {held} held out; training reads ~{passes:.1f} passes", flush=True)
    res = train_draft.train(model, data, args.steps, lr=args.lr, seq_len=args.seq_len,
                            batch=args.batch, progress=False, starts=starts,
                            draft_vocab=args.draft_vocab)
    draft_head.save(res.head, args.out)
    tail = max(1, args.steps // 10)
    t_train = time.perf_counter() - t0 - t_data
    trained_lens = [len(i) for i in ids[:held]]  # the first asks: trained on
    summary = {"paragraphs": len(found), "written": len(written), "prompts": len(texts),
               "tokens": int(len(data)), "passes": passes, "steps": args.steps,
               "loss_first": res.losses[0], "loss_last": float(np.mean(res.losses[-tail:])),
               "top1_last": float(np.mean(res.accuracy[-tail:])),
               "answer_top1_trained": held_out_agreement(model, res.head, asked[:held],
                                                         trained_lens, args.seq_len),
               "answer_top1_held_out": held_out_agreement(model, res.head, held_chats,
                                                          held_lens, args.seq_len),
               "data_s": t_data, "train_s": t_train}
    print(json.dumps(summary), flush=True)
    rows = [summary]
    head = draft_head.load(args.out, model)
    # every round verifying: the acceptance length; with the fallback: what a user gets
    for name, drafter in (("head", dataclasses.replace(head, adaptive=False)),
                          ("head, fallback", head), ("ngram", "ngram")):
        for k in (int(k) for k in args.ks.split(",")):
            for task in speculative_bench.TASKS:
                a = speculative_bench.acceptance(model, drafter, k, task, 160)
                a.update(method=name)
                rows.append(a)
                print(f"{name} K={k} {task}: {a['tokens_per_verification']:.2f} tokens per "
                      f"verification ({a['accepted']}/{a['drafted']} drafts accepted); wall "
                      f"{a['plain_s']:.2f} s plain, {a['speculative_s']:.2f} s speculative = "
                      f"{a['wall_speedup']:.2f}x", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
