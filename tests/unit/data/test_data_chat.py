"""Chat-template loss masks under stock Llama-3 and ChatML templates (no generation markers)."""

from __future__ import annotations

import pytest

from omni_trainer.data.chat import ChatRenderer, ConversationError
from omni_trainer.data.tinyset import train_tokenizer
from omni_trainer.data.tokenizer import load_tokenizer

CORPUS = [
    "Describe the picture. There are two red circles. What colour? They are blue.",
    "How many are there? Three. Which tone is this? It is a high tone. Hello world!",
] * 20

CONVERSATIONS = [
    [("human", "<image>\nDescribe the picture."), ("gpt", "There are two red circles.")],
    [
        ("human", "What colour are they?"),
        ("gpt", "They are blue."),
        ("human", "How many are there?"),
        ("gpt", "Three."),
    ],
    [
        ("system", "You answer briefly."),
        ("human", "Hello"),
        ("gpt", "Hello world!"),
        ("human", "<audio>\nWhich tone is this?"),
        ("gpt", "It is a high tone."),
        ("human", "And this <image>?"),
        ("gpt", "  There are two red circles.  "),
    ],
]
EOT = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>"}


@pytest.fixture(scope="module", params=["chatml", "llama3"])
def tokenizer(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    train_tokenizer(CORPUS, str(out), template=request.param)
    return request.param, load_tokenizer(str(out))


@pytest.mark.parametrize("conv", CONVERSATIONS, ids=["1-turn", "2-turn", "3-turn"])
def test_loss_tokens_are_the_replies_and_their_end_token(tokenizer, conv):
    template, tok = tokenizer
    messages = [{"from": r, "value": v} for r, v in conv]
    media = [("image", 5), ("audio", 3)][: sum(v.count("<") for _, v in conv)]
    out = ChatRenderer(tok).render(messages, media)
    trim = template == "llama3"  # Llama 3's template trims contents, ChatML keeps them as is
    replies = "".join((v.strip() if trim else v) + EOT[template] for r, v in conv if r == "gpt")
    assert tok.decode(out.tokens[out.targets].tolist()) == replies
    # the whole sequence is the template's own tokenization, placeholders expanded
    expected = tok.apply_chat_template(
        [{"role": {"human": "user", "gpt": "assistant"}.get(r, r), "content": v} for r, v in conv],
        tokenize=False,
    )
    text_positions = ~_media_positions(out)
    assert tok.decode(out.tokens[text_positions].tolist()) == expected.replace(
        "<image>", ""
    ).replace("<audio>", "")
    assert sorted((m, n) for m, _, n in out.spans) == sorted(media)
    for _, offset, n in out.spans:
        assert not out.targets[offset : offset + n].any()


def _media_positions(out):
    import numpy as np

    mask = np.zeros(len(out.tokens), dtype=bool)
    for _, offset, n in out.spans:
        mask[offset : offset + n] = True
    return mask


def test_missing_placeholder_is_added_and_extra_ones_are_rejected(tokenizer):
    _, tok = tokenizer
    renderer = ChatRenderer(tok, system_prompt="Be brief.")
    out = renderer.render(
        [{"role": "user", "content": "Describe."}, {"role": "assistant", "content": "Two."}],
        [("image", 4)],
    )
    assert out.spans and out.spans[0][2] == 4 and "Be brief." in out.text
    with pytest.raises(ConversationError) as err:
        two = [{"from": "human", "value": "<image><image>"}, {"from": "gpt", "value": "x"}]
        renderer.render(two, [("image", 2)])
    assert err.value.reason == "placeholder_mismatch"
    with pytest.raises(ConversationError, match="no assistant"):
        renderer.render([{"from": "human", "value": "hi"}])
