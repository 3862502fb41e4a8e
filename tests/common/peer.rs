//! The peer guest that `tests/guest/suite` boots beside the first one
//! (`tests/guest/run --peer`): a second node in a kernel of its own, on a
//! private network (this guest 10.0.0.1, the peer 10.0.0.2). Tests reach
//! it through its command agent, run a ferrovol node service on it, and
//! freeze and thaw it through its QEMU monitor.
#![allow(dead_code)]

use super::fixtures::wait_for;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::time::Duration;

/// This guest's address on the private network.
pub const MAIN_ADDR: &str = "10.0.0.1";
/// The peer's.
pub const PEER_ADDR: &str = "10.0.0.2";
/// The peer's iSCSI initiator name (tests/guest/peer-init sets it).
pub const PEER_INITIATOR: &str = "iqn.2026-11.io.ferrovol:peer";
/// The peer's NVMe host NQN (tests/guest/peer-init writes it, and its
/// host ID, where nvme-cli keeps them: /etc/nvme).
pub const PEER_HOST_NQN: &str =
    "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-0000000000a2";
const AGENT_PORT: u16 = 7000;
const DRIVER_PORT: u16 = 10000;

/// The peer guest.
pub struct Peer;

impl Peer {
    /// The peer, once its agent answers (it boots beside this guest).
    pub fn reach() -> Peer {
        // It boots beside this guest: as long as the suite's own timeout
        // allows, on a busy machine.
        wait_for(
            "the peer guest's agent",
            super::fixtures::DAEMON_BACKSTOP,
            || Peer::try_sh("true").is_ok_and(|(rc, _)| rc == 0),
        );
        Peer
    }

    /// Runs `script` with bash on the peer: its exit code and its output
    /// (stdout and stderr together). The answer ends at the agent's
    /// `peer-exit=N` line: the connection's end can come later.
    pub fn try_sh(script: &str) -> std::io::Result<(i32, String)> {
        let addr = format!("{PEER_ADDR}:{AGENT_PORT}").parse().unwrap();
        let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
        s.set_read_timeout(Some(Duration::from_secs(120)))?;
        // The script, then the end line; the connection stays open both
        // ways until the answer is read.
        s.write_all(format!("{script}\n__FERROVOL_END__\n").as_bytes())?;
        let mut out = String::new();
        for line in BufReader::new(s).lines() {
            let line = line?;
            // The exit line follows the output, on the output's last line
            // when that has no newline.
            if let Some((last, rc)) = line.rsplit_once("peer-exit=") {
                out.push_str(last);
                return Ok((rc.trim().parse().unwrap_or(-1), out));
            }
            out.push_str(&line);
            out.push('\n');
        }
        Err(std::io::Error::other(format!(
            "the peer's agent gave no exit code: {out}"
        )))
    }

    /// Runs `script` on the peer; panics with its output unless it
    /// succeeds. Returns the output.
    pub fn sh(&self, script: &str) -> String {
        match Peer::try_sh(script) {
            Ok((0, out)) => out,
            Ok((rc, out)) => panic!("on the peer, exit {rc}: {script}\n{out}"),
            Err(e) => panic!(
                "the peer's agent: {e} (running {script})\nthe peer's kernel and processes:\n{}",
                Peer::try_sh("dmesg | tail -n 40; ps axfo pid,stat,wchan:20,args | tail -n 40")
                    .map(|(_, o)| o)
                    .unwrap_or_default()
            ),
        }
    }

    /// Stops the peer's virtual CPUs (QEMU `stop`): its kernel stands
    /// still, its connections stay open and unanswered, as a node that
    /// hangs.
    pub fn freeze(&self) {
        qmp("stop");
    }

    /// Lets a frozen peer run again (QEMU `cont`).
    pub fn thaw(&self) {
        qmp("cont");
    }
}

/// Sends one command to the peer's QEMU monitor through this guest's
/// virtio-serial port `peer-qmp`, and waits for its answer.
fn qmp(command: &str) {
    if let Err(e) = try_qmp(command) {
        panic!("QMP {command}: {e}");
    }
}

fn try_qmp(command: &str) -> Result<(), String> {
    static SEQ: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let port = qmp_port()?;
    let mut w = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&port)
        .map_err(|e| format!("{}: {e}", port.display()))?;
    let r = w.try_clone().map_err(|e| e.to_string())?;
    let tag = format!("ferrovol-{n}");
    let (tx, rx) = std::sync::mpsc::channel();
    let want = tag.clone();
    // The answer carries our id; greetings, events and the answer to the
    // capabilities handshake (an error once it was done) pass by.
    std::thread::spawn(move || {
        for line in BufReader::new(r).lines() {
            let Ok(line) = line else { break };
            if line.contains(&want) {
                let _ = tx.send(line);
                break;
            }
        }
    });
    write!(
        w,
        "{{\"execute\":\"qmp_capabilities\"}}\n{{\"execute\":\"{command}\",\"id\":\"{tag}\"}}\n"
    )
    .map_err(|e| e.to_string())?;
    let answer = rx
        .recv_timeout(Duration::from_secs(30))
        .map_err(|_| "no answer in 30 s".to_string())?;
    if answer.contains("\"return\"") {
        Ok(())
    } else {
        Err(answer)
    }
}

/// The device of the virtio-serial port named `peer-qmp`.
fn qmp_port() -> Result<PathBuf, String> {
    let ports = std::fs::read_dir("/sys/class/virtio-ports")
        .map_err(|e| format!("no virtio-serial ports ({e}): was the guest booted with --peer?"))?;
    for e in ports.flatten() {
        let name = std::fs::read_to_string(e.path().join("name")).unwrap_or_default();
        if name.trim() == "peer-qmp" {
            return Ok(PathBuf::from("/dev").join(e.file_name()));
        }
    }
    Err("no virtio-serial port named peer-qmp: was the guest booted with --peer?".into())
}

/// A ferrovol node service on the peer (`--mode node`), in a folder of its
/// own under the peer's /tmp, reached over the private network through a
/// relay to its socket. Stopped when dropped.
pub struct PeerDriver {
    pub peer: Peer,
    /// The driver's folder on the peer.
    pub dir: String,
    pub channel: tonic::transport::Channel,
}

impl PeerDriver {
    /// Starts the node service with `config` (`@DIR@` stands for its
    /// folder) as node `node_name`, and waits until it answers Probe.
    pub async fn start(config: &str, node_name: &str) -> PeerDriver {
        static RUN: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let run = RUN.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let peer = Peer::reach();
        let dir = format!("/tmp/ferrovol-peer-{node_name}-{run}");
        let bin = env!("CARGO_BIN_EXE_ferrovol");
        let config = config.replace("@DIR@", &dir);
        peer.sh(&format!(
            "set -e
d={dir}
rm -rf $d && mkdir -p $d/state $d/kubelet/staging $d/kubelet/pods
cat > $d/config.toml <<'FERROVOL_CONFIG'
{config}
FERROVOL_CONFIG
RUST_LOG='{log}' setsid {bin} serve --mode node --endpoint unix://$d/csi.sock \\
  --node-id {node_name} --state-dir $d/state --config $d/config.toml \\
  >$d/driver.log 2>&1 </dev/null &
echo $! > $d/driver.pid
while kill -0 $(cat $d/driver.pid) 2>/dev/null && [ ! -S $d/csi.sock ]; do sleep 0.1; done
[ -S $d/csi.sock ] || {{ cat $d/driver.log; exit 1; }}
setsid socat TCP-LISTEN:{DRIVER_PORT},bind={PEER_ADDR},reuseaddr,fork UNIX-CONNECT:$d/csi.sock \\
  </dev/null >/dev/null 2>&1 &
echo $! > $d/relay.pid
",
            log = super::DRIVER_LOG
        ));
        let endpoint =
            tonic::transport::Endpoint::from_shared(format!("http://{PEER_ADDR}:{DRIVER_PORT}"))
                .unwrap()
                .connect_timeout(Duration::from_secs(5))
                // No call of a test waits on the peer without end.
                .timeout(Duration::from_secs(180));
        // Until it answers, while it runs.
        let mut last = String::new();
        let deadline = std::time::Instant::now() + super::fixtures::DAEMON_BACKSTOP;
        for round in 0u32.. {
            if std::time::Instant::now() > deadline
                || (round % 50 == 49
                    && peer.sh(&format!("kill -0 $(cat {dir}/driver.pid) 2>/dev/null && echo running || echo gone")).trim()
                        != "running")
            {
                break;
            }
            match endpoint.connect().await {
                Ok(channel) => {
                    let mut id =
                        ferrovol::proto::identity_client::IdentityClient::new(channel.clone());
                    match id.probe(ferrovol::proto::ProbeRequest {}).await {
                        Ok(_) => return PeerDriver { peer, dir, channel },
                        Err(e) => last = e.to_string(),
                    }
                }
                Err(e) => last = e.to_string(),
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!(
            "the peer's driver did not answer: {last}\n{}",
            peer.sh(&format!("cat {dir}/driver.log"))
        );
    }

    pub fn node(&self) -> ferrovol::proto::node_client::NodeClient<tonic::transport::Channel> {
        ferrovol::proto::node_client::NodeClient::new(self.channel.clone())
    }

    /// A path in the driver's folder on the peer.
    pub fn path(&self, rel: &str) -> String {
        format!("{}/{rel}", self.dir)
    }

    /// The peer driver's node id, as NodeGetInfo gives it.
    pub async fn node_id(&self) -> String {
        self.node()
            .node_get_info(ferrovol::proto::NodeGetInfoRequest {})
            .await
            .unwrap()
            .into_inner()
            .node_id
    }

    pub fn log(&self) -> String {
        Peer::try_sh(&format!("cat {}/driver.log", self.dir))
            .map(|(_, out)| out)
            .unwrap_or_default()
    }
}

impl Drop for PeerDriver {
    fn drop(&mut self) {
        // A frozen peer would never answer: thaw it first.
        let _ = try_qmp("cont");
        let _ = Peer::try_sh(&format!(
            "d={}
kill $(cat $d/relay.pid) 2>/dev/null
pid=$(cat $d/driver.pid)
kill -TERM $pid 2>/dev/null
for i in $(seq 100); do kill -0 $pid 2>/dev/null || break; sleep 0.1; done
kill -KILL $pid 2>/dev/null
# What a failed test left mounted there goes (lazily: a dead device
# cannot hold the next test up).
grep -o \" $d/[^ ]*\" /proc/mounts | sort -r | while read -r m; do umount -l \"$m\"; done
true",
            self.dir
        ));
    }
}
