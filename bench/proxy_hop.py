"""What one more process on the way costs by itself: TTFT to the paced fake upstream directly and through a
byte-forwarding asyncio TCP proxy (no parsing, no work), same client, same run, streams started 10 ms apart.

    .venv/bin/python bench/proxy_hop.py

bench/gateway.py --upstream paced-fake --stagger-ms 10 measures the gateway's TTFT overhead the same way; this is
its floor on this machine: the second hop's wake-ups and loopback copies without any of the gateway's work.
"""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import gateway  # noqa: E402  (bench/gateway.py: the paced fake, the clients, the bursts)

#: any prompt: the fake answers token ids whatever it is sent
PROMPT_IDS = list(range(1, 40))


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
    except ConnectionError:
        pass
    finally:
        writer.close()


def serve_proxy(upstream_port: int) -> None:
    """Forward every connection's bytes to 127.0.0.1:upstream_port and back; prints the port it listens on."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", upstream_port)
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    async def run() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        print(server.sockets[0].getsockname()[1], flush=True)
        async with server:
            await server.serve_forever()

    asyncio.run(run())


async def measure(direct_url: str, proxy_url: str, reps: int) -> dict[str, list[float]]:
    clients = gateway.Clients()
    ttft: dict[str, list[float]] = {"direct": [], "proxy": []}
    try:
        for url in (direct_url, proxy_url):
            await gateway.burst(clients, url, 2, 4, PROMPT_IDS)  # warm
        for rep in range(reps):
            for side in ["direct", "proxy"] if rep % 2 == 0 else ["proxy", "direct"]:
                url = direct_url if side == "direct" else proxy_url
                ttft[side] += [r[0] for r in await gateway.burst(clients, url, 16, 16, PROMPT_IDS)]
    finally:
        await clients.aclose()
    return ttft


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--serve-proxy":
        serve_proxy(int(sys.argv[2]))
        return
    fake, fake_url = gateway.start_paced_fake(0.02)
    proxy = subprocess.Popen(
        [sys.executable, __file__, "--serve-proxy", fake_url.rsplit(":", 1)[1]], stdout=subprocess.PIPE, text=True
    )
    try:
        proxy_url = f"http://127.0.0.1:{proxy.stdout.readline().strip()}"
        gateway.STAGGER_S = 0.01
        ttft = asyncio.run(measure(fake_url, proxy_url, reps=8))
    finally:
        fake.kill()
        proxy.kill()
    direct, through = (statistics.median(ttft[side]) * 1000 for side in ("direct", "proxy"))
    print(
        f"TTFT median: direct {direct:.2f} ms, through a byte-forwarding proxy {through:.2f} ms "
        f"({through - direct:+.2f} ms; {len(ttft['direct'])} requests a side)"
    )


if __name__ == "__main__":
    main()
