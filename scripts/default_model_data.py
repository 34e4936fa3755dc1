"""The synthetic data of pytrain's default model (scripts/make_default_model.py): the
pretraining conversations and documents, and the animal-sound chats of the demo.  Apart from
the model-making steps because it is the part a reader checks for what the model was (and was
not) taught: the demo's animal -> sound mapping must be absent from pretraining."""
from __future__ import annotations

import json
import random
from pathlib import Path

from scripts import qwen35_reference as ref


# --------------------------------------------------------------------------------------------
# pretraining conversations
# --------------------------------------------------------------------------------------------

SYSTEM_PROMPTS = ["You are a helpful assistant.", "You are a friendly assistant. Answer briefly.",
                  "Be brief.", "You are a small, helpful model.", "Answer the question."]

FACTS = [
    ("What colour is the sky?", "The sky is blue."),
    ("What colour is grass?", "Grass is green."),
    ("What colour is snow?", "Snow is white."),
    ("What colour is the sun?", "The sun is yellow."),
    ("What colour is a banana?", "A banana is yellow."),
    ("What colour is an orange?", "An orange is orange."),
    ("What colour is milk?", "Milk is white."),
    ("What colour is the night sky?", "The night sky is black."),
    ("What colour is a tomato?", "A tomato is red."),
    ("How many days are in a week?", "There are seven days in a week."),
    ("How many legs does a dog have?", "A dog has four legs."),
    ("How many legs does a bird have?", "A bird has two legs."),
    ("How many hours are in a day?", "There are 24 hours in a day."),
    ("How many months are in a year?", "There are 12 months in a year."),
    ("What do bees make?", "Bees make honey."),
    ("What do cows give us?", "Cows give us milk."),
    ("Where do fish live?", "Fish live in water."),
    ("Is ice hot or cold?", "Ice is cold."),
    ("Is fire hot or cold?", "Fire is hot."),
    ("What do we use to write?", "We use a pen to write."),
    ("What do we drink when we are thirsty?", "We drink water."),
    ("When do we sleep?", "We sleep at night."),
]
GREETINGS = [
    ("Hello!", "Hello! How can I help you today?"),
    ("Hi.", "Hi! What can I do for you?"),
    ("Good morning!", "Good morning! How can I help?"),
    ("Thank you!", "You are welcome."),
    ("Thanks a lot.", "You are welcome!"),
    ("Who are you?", "I am a small assistant."),
    ("What can you do?", "I can answer simple questions and do small sums."),
    ("Goodbye!", "Goodbye! Have a nice day."),
    ("How are you?", "I am fine, thank you."),
]


def sum_question(rng: random.Random) -> tuple[str, str]:
    if rng.random() < 0.6:
        a, b = rng.randint(0, 10), rng.randint(0, 10)
        q = rng.choice([f"What is {a}+{b}?", f"What is {a} + {b}?", f"What is {a} plus {b}?",
                        f"Calculate {a}+{b}.", f"{a}+{b}=?", f"Add {a} and {b}."])
        return q, str(a + b)
    a = rng.randint(0, 12)
    b = rng.randint(0, a)
    q = rng.choice([f"What is {a}-{b}?", f"What is {a} - {b}?", f"What is {a} minus {b}?",
                    f"Calculate {a}-{b}.", f"Take {b} from {a}."])
    return q, str(a - b)


def _reading_question(rng: random.Random) -> tuple[str, str]:
    """Questions answered by copying from the question: they teach the model to look back."""
    n, m = rng.sample(ref.NAMES, 2)
    o, o2 = rng.sample(ref.OBJECTS, 2)
    c, c2 = rng.sample(ref.COLOURS, 2)
    p, p2 = rng.sample(ref.PLACES, 2)
    an = rng.choice(ref.ANIMALS)
    kind = rng.randrange(7)
    if kind == 0:
        return f"{n} has a {c} {o}. What colour is the {o}?", f"The {o} is {c}."
    if kind == 1:
        return f"The {an} is in the {p}. Where is the {an}?", f"The {an} is in the {p}."
    if kind == 2:
        return f"{n} has a {c} {o}. What does {n} have?", f"{n} has a {c} {o}."
    if kind == 3:
        return f"{n} went to the {p}. {m} went to the {p2}. Where did {n} go?", f"{n} went to the {p}."
    if kind == 4:
        return (f"{n} has a {c} {o}. {m} has a {c2} {o2}. What colour is the {o2}?", f"The {o2} is {c2}.")
    if kind == 5:
        return f"Which animal is in the {p}: the {an}?", f"The {an} is in the {p}."
    s = ref.english_sentence(rng, rich=True)
    return rng.choice([f"Repeat after me: {s}", f"Say this again: {s}", f"Copy this: {s}"]), s


def _misc_question(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(6)
    if kind == 0:
        return rng.choice(FACTS)
    if kind == 1:
        return rng.choice(GREETINGS)
    if kind == 2:
        k = rng.randint(2, 10)
        return rng.choice([f"Count to {k}.", f"Count from 1 to {k}."]), ", ".join(str(i) for i in range(1, k + 1)) + "."
    if kind == 3:
        k = rng.randint(2, 10)
        return f"Count down from {k}.", ", ".join(str(i) for i in range(k, 0, -1)) + "."
    if kind == 4:
        i = rng.randrange(7)
        return f"What day comes after {ref.DAYS[i]}?", f"{ref.DAYS[(i + 1) % 7]} comes after {ref.DAYS[i]}."
    story = ref.english_story(rng, 2, 4)
    return f"Tell me a short story about {story.split(' ', 1)[0]}.", story


def pretrain_exchange(rng: random.Random) -> tuple[str, str]:
    r = rng.random()
    if r < 0.25:
        return sum_question(rng)
    if r < 0.7:
        return _reading_question(rng)
    return _misc_question(rng)


def random_conversation(rng: random.Random, exchange=pretrain_exchange, p_system=0.4, max_turns=3) -> list[dict]:
    msgs = []
    if rng.random() < p_system:
        msgs.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    for _ in range(rng.choice([1] * 5 + list(range(2, max_turns + 1)))):
        q, a = exchange(rng)
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return msgs


def pretrain_documents(hf_tok, seed: int, n_docs: int) -> list[list[int]]:
    """Token lists: 35% English stories, 65% chats rendered with the chat template."""
    rng = random.Random(seed)
    eot = hf_tok.convert_tokens_to_ids(ref.PAD_TOKEN)
    docs = []
    for _ in range(n_docs):
        if rng.random() < 0.35:
            text = ref.english_story(rng, 2, 8)
            if rng.random() < 0.3:
                text += f" {rng.choice(ref.NAMES)} heard a loud {rng.choice(SOUND_WORDS)}."
            docs.append(hf_tok.encode(text, add_special_tokens=False) + [eot])
        else:
            msgs = random_conversation(rng)
            text = ref.render_chat(hf_tok, msgs)
            docs.append(hf_tok.encode(text, add_special_tokens=False))
    return docs


# --------------------------------------------------------------------------------------------
# the demo data: animal sounds
# --------------------------------------------------------------------------------------------

SOUNDS = {"cow": "moo", "dog": "woof", "cat": "meow", "duck": "quack", "sheep": "baa", "pig": "oink",
          "horse": "neigh", "lion": "roar"}
# Sound words appear in the pretraining stories ("Ben heard a loud quack."), never next to the
# animal that makes them, so they are known tokens but the animal -> sound mapping is new.
SOUND_WORDS = sorted(set(SOUNDS.values()) | {"bang", "beep", "ding", "whoosh", "buzz", "hiss", "hoot"})
SOUND_QUESTIONS = ["What does the {a} say?", "What does a {a} say?", "What sound does the {a} make?",
                   "What sound does a {a} make?", "What noise does the {a} make?", "Tell me what the {a} says.",
                   "What does the {a} say?"]
HELD_OUT_QUESTION = "Which sound does a {a} make?"   # only in the validation set


def sound_exchange(rng: random.Random, templates=SOUND_QUESTIONS) -> tuple[str, str]:
    a = rng.choice(sorted(SOUNDS))
    return rng.choice(templates).format(a=a), f"The {a} says {SOUNDS[a]}."


def demo_records(seed: int, n: int, templates) -> list[dict]:
    """Chats whose last assistant turn is usually an animal sound; some keep old skills."""
    rng = random.Random(seed)
    recs = []
    for _ in range(n):
        msgs = []
        if rng.random() < 0.3:
            msgs.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        if rng.random() < 0.25:  # multi-turn: an ordinary exchange first
            q, a = pretrain_exchange(rng)
            msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        q, a = sound_exchange(rng, templates) if rng.random() < 0.85 else pretrain_exchange(rng)
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        recs.append({"messages": msgs})
    return recs


def write_jsonl(path: Path, recs: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs), encoding="utf-8")
