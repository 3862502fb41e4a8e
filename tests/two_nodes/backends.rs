//! Each backend between the two nodes: nfs written from both, iscsi, nvmf
//! and rbd moved, shared and fenced.

use super::scenarios::*;
use super::*;

/// An nfs volume staged on both nodes at once: each sees the files the
/// other writes, through its own mount of the export. (nfs has no attach:
/// nothing to publish to a node, nothing to fence.)
#[tokio::test]
#[ignore = "needs the two-node guest: run tests/guest/suite"]
async fn guest_two_nodes_nfs_volume_is_written_from_both() {
    require_guest();
    let server = NfsServer::new();
    let config = format!(
        "[[backend]]\ntype = \"nfs\"\n[[backend.export]]\nname = \"main\"\nserver = \"{MAIN_ADDR}\"\n\
         share = \"/\"\nversion = \"4.2\"\n"
    );
    let h = Harness::start_with(Some(&config)).await;
    let a = PeerDriver::start(&config, "node-a").await;
    let n = Nodes::new(&h, &a, &Secrets::new()).await;
    let cap = mount_cap("", MNMW);
    let id = n.create("pvc-two-nfs", 64 * MIB, &cap).await;
    let on_a = n.stage_a(&id, "nfs", &cap, &Context::new()).await;
    let on_b = n.stage_b(&id, "nfs", &cap, &Context::new()).await;
    let (a_target, b_target) = (&on_a.1, &on_b.1);
    // Both write at once; each sees the other's file.
    let writer_a = Peer::try_sh(&format!(
        "for i in $(seq 50); do echo $i >> {a_target}/from-a; done; sync"
    ));
    for i in 1..=50 {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(b_target.join("from-b"))
            .unwrap();
        writeln!(f, "{i}").unwrap();
    }
    assert_eq!(writer_a.unwrap().0, 0);
    let lines = |text: String| text.lines().count();
    wait_for("B to see A's file", Duration::from_secs(30), || {
        std::fs::read_to_string(b_target.join("from-a")).is_ok_and(|t| lines(t) == 50)
    });
    wait_for("A to see B's file", Duration::from_secs(30), || {
        Peer::try_sh(&format!("cat {a_target}/from-b"))
            .is_ok_and(|(rc, out)| rc == 0 && lines(out) == 50)
    });
    assert_eq!(
        std::fs::read_to_string(server.export.join("pvc-two-nfs/from-a"))
            .map(lines)
            .unwrap(),
        50
    );
    n.unstage_a(&id, &on_a).await;
    n.unstage_b(&id, &on_b).await;
    n.nothing_mounted_on_a();
    n.delete(&id).await;
}

/// [`move_block`], [`share_block`] and [`move_and_fence`] on iscsi (the
/// shared volume granted to both initiators at once): the detach takes A's
/// initiator out of the target's ACL and closes its connections.
#[tokio::test]
#[ignore = "needs the two-node guest: run tests/guest/suite"]
async fn guest_two_nodes_iscsi_moves_shares_fences_and_lets_a_gone_node_go() {
    require_guest();
    let prefix = "iqn.2026-11.io.ferrovol.two";
    let tgtd = Tgtd::on(MAIN_ADDR);
    let _iscsid = Iscsid::new();
    let config = iscsi_config(prefix, &tgtd);
    let h = Harness::start_with(Some(&config)).await;
    let sessions = || {
        Peer::try_sh("iscsiadm -m session 2>/dev/null; true")
            .unwrap()
            .1
            .lines()
            .filter(|l| l.contains(prefix))
            .count()
    };
    let shut_out = || {
        let t = tgtd.tgtadm(&["--op", "show", "--mode", "target"]);
        match t.contains(PEER_INITIATOR) {
            true => Err(format!("the target still lists A:\n{t}")),
            false => Ok(()),
        }
    };
    let backend = Backend {
        secrets: Secrets::new(),
        a_named: PEER_INITIATOR,
        a_holds: &|| sessions() > 0,
        a_shut_out: &shut_out,
        gone_node: (
            "node-gone/iqn.2026-11.io.ferrovol:gone",
            "iqn.2026-11.io.ferrovol:gone",
        ),
    };
    let a = PeerDriver::start(&config, "node-a").await;
    let n = Nodes::new(&h, &a, &backend.secrets).await;
    node_gone(&n, &backend).await;
    move_block(&n, &backend, "pvc-two-iscsi-blk").await;
    share_block(&n, "pvc-two-iscsi-shared").await;
    move_and_fence(&n, &backend, "pvc-two-iscsi").await;
    let left = tgtd.tgtadm(&["--op", "show", "--mode", "target"]);
    assert!(!left.contains(prefix), "{left}");
}

/// [`move_block`], [`share_block`] and [`move_and_fence`] on nvmf (both
/// host NQNs allowed on the shared volume's subsystem): the detach takes A's
/// host NQN out of the subsystem's allowed hosts and the subsystem off its
/// port and back, which drops A's controller; A, refused when it
/// connects again, removes it.
#[tokio::test]
#[ignore = "needs the two-node guest: run tests/guest/suite"]
async fn guest_two_nodes_nvmf_moves_shares_fences_and_lets_a_gone_node_go() {
    require_guest();
    let prefix = "nqn.2026-12.io.ferrovol.two";
    let nvmet = NvmetPort::on(MAIN_ADDR, prefix);
    let (config, peer_config) = nvmf_configs(&nvmet);
    let h = Harness::start_with(Some(&config)).await;
    let controllers = || {
        Peer::try_sh("cat /sys/class/nvme/*/subsysnqn 2>/dev/null; true")
            .unwrap()
            .1
            .lines()
            .filter(|l| l.starts_with(&format!("{prefix}:")))
            .count()
    };
    let shut_out = || {
        let allowed: Vec<String> = nvmet
            .subsystems()
            .iter()
            .flat_map(|s| {
                std::fs::read_dir(format!("{NVMET}/subsystems/{s}/allowed_hosts"))
                    .into_iter()
                    .flatten()
                    .flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
            })
            .collect();
        match allowed.iter().any(|h| h == PEER_HOST_NQN) {
            true => Err(format!("a subsystem still allows A: {allowed:?}")),
            false => Ok(()),
        }
    };
    let backend = Backend {
        secrets: Secrets::new(),
        a_named: PEER_HOST_NQN,
        a_holds: &|| controllers() > 0,
        a_shut_out: &shut_out,
        gone_node: (
            "node-gone/nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-00000000dead",
            "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-00000000dead",
        ),
    };
    let a = PeerDriver::start(&peer_config, "node-a").await;
    let n = Nodes::new(&h, &a, &backend.secrets).await;
    node_gone(&n, &backend).await;
    move_block(&n, &backend, "pvc-two-nvmf-blk").await;
    share_block(&n, "pvc-two-nvmf-shared").await;
    move_and_fence(&n, &backend, "pvc-two-nvmf").await;
    assert_eq!(nvmet.subsystems(), Vec::<String>::new(), "subsystems left");
    assert_eq!(controllers(), 0, "A's controllers left");
}

/// [`move_block`], [`share_block`] and [`move_and_fence`] on rbd: the detach blocklists the
/// client A recorded at stage (each mapping has its own), before A's mark
/// goes.
#[tokio::test]
#[ignore = "needs the two-node guest: run tests/guest/suite"]
async fn guest_two_nodes_rbd_moves_shares_fences_and_lets_a_gone_node_go() {
    require_guest();
    let cluster = CephCluster::shared();
    let (config, peer_config) = rbd_configs(cluster);
    let h = Harness::start_with(Some(&config)).await;
    let secrets = cluster.secrets();
    let mapped = || {
        Peer::try_sh("rbd device list 2>/dev/null; true")
            .unwrap()
            .1
            .lines()
            .filter(|l| l.contains("rbd "))
            .count()
    };
    let blocklist = || cluster.ceph(&["osd", "blocklist", "ls"]);
    let before = blocklist();
    let shut_out = || {
        let now = blocklist();
        match now.contains(&format!("{PEER_ADDR}:0/")) && now != before {
            true => Ok(()),
            false => Err(format!("A's client is not blocklisted:\n{now}")),
        }
    };
    let a = PeerDriver::start(&peer_config, "node-a").await;
    let backend = Backend {
        secrets: secrets.clone(),
        a_named: "node-a",
        a_holds: &|| mapped() > 0,
        a_shut_out: &shut_out,
        gone_node: ("node-gone/rbd", "node-gone"),
    };
    let n = Nodes::new(&h, &a, &backend.secrets).await;
    node_gone(&n, &backend).await;
    move_block(&n, &backend, "pvc-two-rbd-blk").await;
    share_block(&n, "pvc-two-rbd-shared").await;
    move_and_fence(&n, &backend, "pvc-two-rbd").await;
    let left = cluster.rbd(&["ls", "rbd"]);
    assert!(left.trim().is_empty(), "{left}");
}
