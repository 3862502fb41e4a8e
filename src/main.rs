//! `ferrovol`: read settings, build the driver, serve until SIGTERM/SIGINT.

use clap::{Parser, Subcommand, ValueEnum};
use ferrovol::app::{self, Settings};
use ferrovol::server::{self, Endpoint};
use ferrovol::service::Mode;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Parser)]
#[command(name = "ferrovol", version = env!("CARGO_PKG_VERSION"), about = "A Kubernetes CSI driver")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Human,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// A CSI client for any driver: every RPC, text or JSON answers, exit
    /// status 10 + the gRPC code of a failed call.
    Client(ferrovol::client::Args),
    /// Serve the CSI services.
    Serve(ServeArgs),
    /// Holds a group snapshot's freeze for the driver that runs it (see
    /// src/host/freeze.rs); not for use by hand.
    #[command(name = "freeze-holder", hide = true)]
    FreezeHolder,
    /// A backend's helper the driver starts from its own binary
    /// (`backend::Kind::helpers`: lvm's `lvm-helper`); not for use by hand.
    #[command(external_subcommand)]
    Helper(Vec<String>),
}

/// The settings of `serve`.
#[derive(clap::Args)]
struct ServeArgs {
    /// unix:///path/csi.sock or tcp://host:port
    #[arg(
        long,
        env = "CSI_ENDPOINT",
        default_value = "unix:///run/ferrovol/csi.sock"
    )]
    endpoint: String,
    /// This node's id (default: the hostname).
    #[arg(long, env = "FERROVOL_NODE_ID")]
    node_id: Option<String>,
    #[arg(long, env = "FERROVOL_DRIVER_NAME", default_value = "csi.ferrovol.io")]
    driver_name: String,
    #[arg(long, env = "FERROVOL_MODE", value_enum, default_value = "all")]
    mode: Mode,
    /// Where node state (and the default file pool) lives.
    #[arg(long, env = "FERROVOL_STATE_DIR", default_value = "/var/lib/ferrovol")]
    state_dir: PathBuf,
    /// TOML config file, or a directory of them (`*.toml`, added up in
    /// name order); without one the `file` backend is enabled.
    #[arg(long, env = "FERROVOL_CONFIG")]
    config: Option<PathBuf>,
    #[arg(long, env = "FERROVOL_LOG_FORMAT", value_enum, default_value = "human")]
    log_format: LogFormat,
    /// Caps every external command's timeout, and every librbd call's
    /// deadline (seconds); a command still running then is killed and its
    /// call fails.
    #[arg(long, env = "FERROVOL_COMMAND_TIMEOUT")]
    command_timeout: Option<u64>,
    /// Seconds in-flight calls get to finish at shutdown.
    #[arg(long, env = "FERROVOL_SHUTDOWN_GRACE", default_value_t = 30)]
    shutdown_grace: u64,
    /// TLS for a tcp:// endpoint: the server's certificate (PEM).
    #[arg(long, env = "FERROVOL_TLS_CERT")]
    tls_cert: Option<PathBuf>,
    /// The server's private key (PEM).
    #[arg(long, env = "FERROVOL_TLS_KEY")]
    tls_key: Option<PathBuf>,
    /// The CA that signs client certificates (PEM); clients must present
    /// one (mutual TLS).
    #[arg(long, env = "FERROVOL_TLS_CLIENT_CA")]
    tls_client_ca: Option<PathBuf>,
    /// Client connections open at once; more wait until one closes.
    #[arg(long, env = "FERROVOL_MAX_CONNECTIONS", default_value_t = 256)]
    max_connections: usize,
    /// Concurrent calls on one connection (HTTP/2 streams).
    #[arg(long, env = "FERROVOL_MAX_STREAMS", default_value_t = 64)]
    max_streams: u32,
    /// Seconds a new connection has to start talking HTTP/2 before it is
    /// closed.
    #[arg(long, env = "FERROVOL_HANDSHAKE_TIMEOUT", default_value_t = 10)]
    handshake_timeout: u64,
    /// host:port to serve Prometheus metrics (/metrics), /healthz and
    /// /readyz on, over plain HTTP; off by default.
    #[arg(long, env = "FERROVOL_METRICS_ADDR")]
    metrics_addr: Option<std::net::SocketAddr>,
    /// Do not offer ControllerExpandVolume: the external-resizer then
    /// leaves expansion to kubelet, and NodeExpandVolume grows a
    /// node-local LV or image on its node (for the node-local driver's
    /// central controller).
    #[arg(long, env = "FERROVOL_NO_CONTROLLER_EXPANSION")]
    no_controller_expansion: bool,
    /// This process is the central controller of a node-local driver: its
    /// volumes are on the nodes, none of them here. Implies
    /// --no-controller-expansion; ControllerModifyVolume answers
    /// INVALID_ARGUMENT (the external-resizer's Infeasible) saying that a
    /// node-local volume's mutable parameters are set when it is created.
    #[arg(long, env = "FERROVOL_VOLUMES_ON_NODES")]
    volumes_on_nodes: bool,
    /// Advertise CSI v1.13's volume health capabilities (controller
    /// LIST_VOLUME_HEALTH and GET_VOLUME_HEALTH, node GET_VOLUME_HEALTH and
    /// STORAGE_HEALTH). The four calls are answered either way; callers
    /// built against v1.12 may refuse capability values they do not know
    /// (csi-sanity v1.12 does), so this is for clusters whose callers are
    /// built against v1.13.
    #[arg(long, env = "FERROVOL_VOLUME_HEALTH")]
    volume_health: bool,
}

fn init_logging(format: LogFormat) {
    let filter =
        tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    use std::io::IsTerminal;
    // Colour only where a person reads a terminal, never into a file or
    // a pipe (what `kubectl logs` shows).
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Human => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM"),
        _ = int.recv() => tracing::info!("SIGINT"),
    }
}

/// Every connection, mount helper and device is a descriptor: take the hard
/// limit, as the connection cap and the backends are sized against it.
fn raise_file_limit() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    if let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) {
        if soft < hard {
            if let Err(e) = setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
                tracing::warn!(error = %e, soft, hard, "could not raise the open-file limit");
            }
        }
    }
}

fn main() -> std::process::ExitCode {
    match Cli::parse().command {
        Command::Client(args) => {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("tokio runtime");
            std::process::ExitCode::from(runtime.block_on(ferrovol::client::run(args)) as u8)
        }
        Command::Serve(args) => serve(args),
        Command::FreezeHolder => {
            std::process::ExitCode::from(ferrovol::host::freeze::holder_main() as u8)
        }
        Command::Helper(args) => match ferrovol::backend::helper(&args[0]) {
            Some(helper) if args.len() == 1 => std::process::ExitCode::from((helper.main)() as u8),
            Some(_) => {
                eprintln!("error: ferrovol {} takes no arguments", args[0]);
                std::process::ExitCode::from(2)
            }
            None => {
                eprintln!(
                    "error: unrecognized subcommand '{}'\n\nFor more information, try '--help'.",
                    args[0]
                );
                std::process::ExitCode::from(2)
            }
        },
    }
}

/// `serve`: the driver, until SIGTERM or SIGINT.
fn serve(args: ServeArgs) -> std::process::ExitCode {
    limit_malloc_arenas();
    init_logging(args.log_format);
    ferrovol::killpoint::announce(&ferrovol::backend::kill_points());
    raise_file_limit();
    // Whatever the driver or a tool it runs creates (images, records,
    // keyrings, working directories) is root's alone unless a mode is
    // asked for (the socket, the directories NFS volumes get).
    nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o077));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    match runtime.block_on(run(args)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %e.message, "ferrovol stopped");
            eprintln!("ferrovol: {}", e.message);
            std::process::ExitCode::FAILURE
        }
    }
}

/// glibc's allocator gives each thread that allocates an arena of its
/// own, up to eight per CPU: the blocking pool's threads (mount table
/// reads, records), busy at once under concurrent calls, each kept pages
/// of one. Two arenas, for the runtime's two workers: the driver's peak
/// RSS under 8 clients publishing went from 13.4-13.6 MiB to 12.5-13.0
/// (one arena: no lower), its rate within the runs' noise (2026-12-02).
fn limit_malloc_arenas() {
    // SAFETY: mallopt(3) takes two integers and only changes the
    // allocator's settings; it runs before the driver starts any thread.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 2);
    }
}

async fn run(a: ServeArgs) -> ferrovol::error::Result<()> {
    let endpoint = Endpoint::parse(&a.endpoint)?;
    let tls = server::TlsFiles::from_flags(a.tls_cert, a.tls_key, a.tls_client_ca)?;
    server::check_endpoint(&endpoint, tls.as_ref())?;
    let node_id = match a.node_id {
        Some(n) => n,
        None => nix::unistd::gethostname()
            .map(|h| h.to_string_lossy().into_owned())
            .map_err(|e| ferrovol::error::Error::internal(format!("hostname: {e}")))?,
    };
    let settings = Settings {
        driver_name: a.driver_name,
        node_id,
        mode: a.mode,
        state_dir: a.state_dir,
        config: a.config,
        command_timeout: a.command_timeout.map(Duration::from_secs),
        metrics: a.metrics_addr.is_some(),
        controller_expansion: !a.no_controller_expansion && !a.volumes_on_nodes,
        volumes_on_nodes: a.volumes_on_nodes,
        volume_health: a.volume_health,
    };
    let driver = app::build(&settings)?;
    app::start_backends(&driver).await?;
    app::start_limit_refresh(&driver);
    if let Some(addr) = a.metrics_addr {
        ferrovol::server::http::serve(addr, driver.clone()).await?;
    }
    let served = server::serve(
        driver.clone(),
        endpoint,
        tls,
        server::Limits {
            max_connections: a.max_connections,
            max_streams: a.max_streams,
            handshake_timeout: Duration::from_secs(a.handshake_timeout),
        },
        shutdown_signal(),
        Duration::from_secs(a.shutdown_grace),
    )
    .await;
    app::stop_backends(&driver).await;
    served
}
