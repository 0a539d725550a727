"""The server's worker: one thread owns the model and runs the queued generations one at a time, in arrival order
(the caches hold one conversation, and prefix reuse carries from one request to the next). A Job carries one
request's events back to the event loop that serves it."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading

from ..runtime.engine import Cancelled

log = logging.getLogger("gemma_ane.server.app")

END = object()  # the worker's last item for a job: nothing more will come


class Echo(list):
    """A job's first item when it asked for its prompt's logprobs: Model.prompt_logprobs's list."""


class Job:
    """One request: its Prepared generations (one a prompt: a completion may send a batch) and how many choices to
    run in all, n a prompt in order (choice i: Model.choice, made in the worker, after the queue admitted the job), a
    cancel flag the worker checks between tokens (the runtime, between the prompt's steps and prefill batches), and
    the asyncio queue its items come back on: (choice index, event) pairs, an error, END. `score`: (prompt ids, top)
    to report the prompt's logprobs first, as an Echo."""

    def __init__(
        self,
        rid: str,
        prepared,
        loop: asyncio.AbstractEventLoop,
        n: int = 1,
        score: tuple[list[int], int] | None = None,
    ):
        self.id, self.prepared, self.loop = rid, prepared, loop
        self.n, self.score = n, score
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()

    def cancel(self) -> None:
        self.cancelled.set()

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.cancel()

    async def next(self):
        return await self.events.get()


class Worker:
    """Owns the model: one thread runs queued jobs in order. `max_queue` jobs may wait behind the
    running one; `submit` refuses the next."""

    def __init__(self, model, max_queue: int):
        self.model, self.max_queue = model, max_queue
        self._jobs: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._admitted = 0  # waiting + running
        self._thread: threading.Thread | None = None
        self.current: Job | None = None

    @property
    def waiting(self) -> int:
        return self._admitted - (self.current is not None)

    def admit(self) -> bool:
        """A place in the queue for a job about to be prepared (the cheap check before any per-request work), or
        False when it is full; the caller then `run`s the job or `release`s the place."""
        with self._lock:
            if self._admitted > self.max_queue:
                return False
            self._admitted += 1
            return True

    def release(self) -> None:
        with self._lock:
            self._admitted -= 1

    def run(self, job: Job) -> None:
        """Queue a job `admit` made room for."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="gemma-ane-engine", daemon=True)
                self._thread.start()
        self._jobs.put(job)

    def submit(self, job: Job) -> bool:
        """admit, then run: whether the job was queued."""
        if not self.admit():
            return False
        self.run(job)
        return True

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel everything and let the thread finish its current token."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is None:
            return
        for job in list(self._jobs.queue):
            if job is not None:
                job.cancel()
        if self.current is not None:
            self.current.cancel()
        self._jobs.put(None)
        thread.join(timeout)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            self.current = job
            try:
                if not job.cancelled.is_set():
                    self._generate(job)
            finally:
                self.current = None
                with self._lock:
                    self._admitted -= 1
                job.put(END)

    def _generate(self, job: Job) -> None:
        if job.score is not None and not self._guarded(job, self._score, job):
            return
        for index in range(job.n):
            if job.cancelled.is_set() or not self._guarded(job, self._choice, job, index):
                return

    def _score(self, job: Job) -> None:
        ids, top = job.score
        job.put(Echo(self.model.prompt_logprobs(ids, top, cancelled=job.cancelled.is_set)))

    def _guarded(self, job: Job, run, *args) -> bool:
        """run(*args), its failure logged and sent to the client (then nothing more runs for the job); whether
        it went through."""
        try:
            run(*args)
            return True
        except Cancelled as e:
            log.info("%s: client gone, %s", job.id, e)
        except ValueError as e:  # the request's fault (sampling, template, context): reported as 400
            log.info("%s: refused: %s", job.id, e)
            job.put(e)
        except Exception as e:
            log.exception("%s: generation failed", job.id)
            job.put(e)
        return False

    def _choice(self, job: Job, index: int) -> None:
        tokens = 0
        per = job.n // len(job.prepared)  # a batch's prompt k runs choices k*per .. k*per+per-1
        prepared = self.model.choice(job.prepared[index // per], index % per)
        # asked during the prompt's processing too: a client gone while a long prompt runs frees the engine
        events = self.model.stream_generate(request=prepared, cancelled=job.cancelled.is_set)
        try:
            for ev in events:
                job.put((index, ev))
                tokens += ev.token is not None
                if job.cancelled.is_set():
                    # closing the generator at a yield leaves the caches and `cached` in step
                    log.info("%s: client gone, generation stopped after %d tokens", job.id, tokens)
                    return
        finally:
            events.close()
        log.info(  # one line a choice: what an operator reads to see the cache and the speeds at work
            "%s: choice %d: prompt %d tokens (%d reused, %.1f tok/s), generated %d (%.1f tok/s), finish %s",
            job.id,
            index,
            ev.prompt_tokens,
            ev.reused_tokens,
            ev.prefill_tokens_per_s,
            ev.generated_tokens,
            ev.decode_tokens_per_s,
            ev.finish_reason,
        )
