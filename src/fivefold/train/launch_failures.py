"""A launch that never reaches the first step, in one sentence with its fix: the rendezvous port is
taken, node 0 cannot be reached, or a node never joins.

torch elastic (our launcher, torchrun) and `init_process_group` (env://: RANK, MASTER_ADDR,
MASTER_PORT) raise these as chains of their own exceptions (RendezvousConnectionError over
DistNetworkError over the socket's EADDRINUSE, RendezvousTimeoutError, DistStoreError "timed out
... waiting for clients") whose traceback says nothing about what to do. `launch_problem` reads the
chain and names the address, the flag that sets it and the fix.
"""

from __future__ import annotations


def _chain(err: BaseException) -> list[BaseException]:
    out, seen = [], set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        out.append(err)
        err = err.__cause__ or err.__context__
    return out


def launch_problem(err: BaseException, address: str, flag: str, nnodes: int = 1,
                   timeout_s: float | None = None) -> tuple[str, int] | None:
    """(the sentence, the exit code: 2 for a port to change, 3 for a node not met) for a rendezvous or
    store failure met at `address` (set by `flag`), or None when `err` is not one."""
    from torch.distributed import DistError
    from torch.distributed.elastic.rendezvous.api import RendezvousError, RendezvousTimeoutError

    chain = _chain(err)
    if not any(isinstance(e, (RendezvousError, DistError)) for e in chain):
        return None
    text = " ".join(str(e) for e in chain).lower()
    port = address.rpartition(":")[2]
    if "eaddrinuse" in text or "address already in use" in text:
        return (f"the rendezvous port {port} of {flag} {address} is already in use on this machine (another job, or "
                f"an earlier launcher that has not exited, holds it); choose a free port for {flag} (the same on "
                f"every node) or end the process that holds it (`ss -ltnp | grep :{port}` shows it)", 2)
    waited = f" within {timeout_s:g} s" if timeout_s else ""
    if any(isinstance(e, RendezvousTimeoutError) for e in chain) or ("timed out" in text or "timeout" in text):
        return (f"not every node joined the rendezvous at {flag} {address}{waited} ({nnodes} expected); start the "
                f"same command on each node with its own --node-rank and the same {flag}, check that every node "
                f"can reach {address}, or raise parallel.timeout_s if the nodes start far apart", 3)
    return (f"could not reach the rendezvous at {flag} {address}; start node 0 (--node-rank 0, which hosts it) "
            f"first, check the address, and check that port {port} is open between the nodes", 3)
