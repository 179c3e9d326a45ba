"""The demo workload, modelled on Long-Doc-QA: long documents, each asked several questions.

Every prompt is a document followed by a short question. The requests run in rounds: round
``q`` asks question ``q`` of every document, and the documents of a round are spread over
the engines so that a document's next question goes to a different engine than the last
one. Round 0 finds nothing cached and stores every document; later rounds should load the
document's chunks from the cache, written by another engine process.

All token ids come from RNGs seeded with (seed, document, question), so each engine process
builds the same prompts without being sent them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

VOCAB_SIZE = 32_000
QUESTION_TOKENS = (24, 96)  # a question's length is drawn from this range


@dataclass(frozen=True)
class Request:
    """One prompt: question ``query`` about document ``doc``."""

    doc: int
    query: int

    @property
    def request_id(self) -> str:
        return f"doc{self.doc}-q{self.query}"


@dataclass(frozen=True)
class Workload:
    documents: int = 8
    doc_tokens: int = 10_000
    queries_per_doc: int = 2
    seed: int = 0

    def document(self, doc: int) -> npt.NDArray[np.uint32]:
        rng = np.random.default_rng([self.seed, doc])
        return rng.integers(0, VOCAB_SIZE, self.doc_tokens, dtype=np.uint32)

    def _question_rng(self, request: Request) -> np.random.Generator:
        return np.random.default_rng([self.seed, request.doc, request.query, 1])

    def question_tokens(self, request: Request) -> int:
        return int(self._question_rng(request).integers(*QUESTION_TOKENS))

    def prompt(self, request: Request) -> npt.NDArray[np.uint32]:
        """The token ids of a request: its document, then its question."""
        rng = self._question_rng(request)
        length = int(rng.integers(*QUESTION_TOKENS))
        question = rng.integers(0, VOCAB_SIZE, length, dtype=np.uint32)
        return np.concatenate([self.document(request.doc), question])

    @property
    def max_prompt_tokens(self) -> int:
        return self.doc_tokens + QUESTION_TOKENS[1]

    def distinct_chunks(self, chunk_tokens: int) -> int:
        """How many different full chunks all prompts make: the working set of the cache.
        A document's chunks are shared by its questions; a chunk that reaches into the
        question is the question's own."""
        shared = self.doc_tokens // chunk_tokens
        total = 0
        for doc in range(self.documents):
            total += shared
            for query in range(self.queries_per_doc):
                length = self.doc_tokens + self.question_tokens(Request(doc, query))
                total += length // chunk_tokens - shared
        return total

    @property
    def requests(self) -> int:
        return self.documents * self.queries_per_doc

    def rounds(self, engines: int) -> list[list[list[Request]]]:
        """``rounds(n)[q][e]``: the requests engine ``e`` serves in round ``q``."""
        out: list[list[list[Request]]] = []
        for query in range(self.queries_per_doc):
            per_engine: list[list[Request]] = [[] for _ in range(engines)]
            for doc in range(self.documents):
                per_engine[(doc + query) % engines].append(Request(doc, query))
            out.append(per_engine)
        return out
