//! dractl: the drust CLI.

use std::io::{BufReader, Write};

use anyhow::Context;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "dractl", about = "drust CLI")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// DRA CEL selectors.
    Cel {
        #[command(subcommand)]
        command: CelCommand,
    },
    /// Allocate a pod's claims on each node as kube-scheduler v1.36 would, offline.
    ///
    /// Reads Nodes, DeviceClasses, ResourceSlices and ResourceClaims (YAML or JSON as
    /// `kubectl get -o yaml|json` prints them). Claims without status.allocation are the pod's
    /// claims; those with one are in use. Invalid input exits with status 2.
    Allocate {
        /// Input file (`-` for stdin); repeatable.
        #[arg(short = 'f', long = "filename", required = true)]
        files: Vec<String>,
        /// Only this node.
        #[arg(long)]
        node: Option<String>,
        /// Output format.
        #[arg(short = 'o', long = "output", value_enum, default_value = "json")]
        output: dractl::allocate::Format,
        /// Time allowed per node, e.g. `10s`, `500ms`, `1m 30s`, `0` to disable (the
        /// scheduler's filterTimeout).
        #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
        timeout: std::time::Duration,
        /// Apply the fix of an upstream allocator bug that kube-scheduler v1.36.3 still has
        /// (default: behave exactly as it does). Known: 140438 (distinctAttribute lets a
        /// request with several devices repeat a value; kubernetes/kubernetes PR #140600).
        #[arg(long = "fix-upstream-bug", value_name = "ISSUE", value_parser = ["140438"])]
        fix_upstream_bug: Vec<String>,
    },
    /// Why a pod's claims do not fit: per node, each request's devices stage by stage.
    ///
    /// Reads the same files as `allocate`. Prints a verdict, then the nodes grouped by reason,
    /// each group with the funnel of its first node: devices offered, left after the class's
    /// and the request's selectors, not in use, taints tolerated, counters and capacity left,
    /// and the claim's constraints, with what removed them. Invalid input exits with status 2.
    ///
    /// `dractl explain pod NAMESPACE/NAME` (or `claim NAMESPACE/NAME`) reads a live cluster
    /// instead, as kubectl does (`--kubeconfig`, `--context`, else `KUBECONFIG`,
    /// `~/.kube/config`, in-cluster); read-only, RBAC in `deploy/rbac/dractl-explain.yaml`.
    Explain {
        /// What to explain in a live cluster.
        #[arg(value_enum, requires = "name", conflicts_with = "files")]
        target: Option<dractl::live::Target>,
        /// NAMESPACE/NAME of the pod or claim.
        name: Option<String>,
        /// Input file (`-` for stdin); repeatable.
        #[arg(short = 'f', long = "filename", required_unless_present = "target")]
        files: Vec<String>,
        /// Kubeconfig file (live cluster).
        #[arg(long)]
        kubeconfig: Option<std::path::PathBuf>,
        /// Kubeconfig context (live cluster).
        #[arg(long)]
        context: Option<String>,
        /// Only this node.
        #[arg(long)]
        node: Option<String>,
        /// Output format.
        #[arg(short = 'o', long = "output", value_enum, default_value = "text")]
        output: dractl::explain::Format,
        /// Time allowed per node (the scheduler's filterTimeout); `0` disables.
        #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
        timeout: std::time::Duration,
    },
    /// How many more pods with these claim templates fit, on which nodes, and what stops the
    /// next one; or whether a job of N pods, or a gang, fits, where, and what blocks it.
    ///
    /// Without `--count` or a gang: places pods one after the other, each on the first node
    /// (input order) where its claims fit, their devices then in use; stops when one fits
    /// nowhere (and explains why). Exit status 0, 2 for bad input, 1 when the cluster cannot be
    /// read.
    ///
    /// With `--count`, `--job`, `--gang`, `--min-count`, `--topology-key` or `--pod-group`: a
    /// job. Its
    /// pods are placed in order on one snapshot as kube-scheduler v1.36's PodGroup cycle does
    /// (first feasible node in input order where the scheduler scores; device choices as the
    /// scheduler's, never revisited, kubernetes/kubernetes#138765), all or nothing for a gang,
    /// each domain of the topology key tried, a PodGroup's claims allocated once with the first
    /// pod and bounding every pod (KEP-5729). Also says whether devices chosen together would
    /// fit where the scheduler's order does not. Exit status 0 when it fits, 1 when it does not,
    /// 2 when it cannot be answered (bad input, the cluster cannot be read).
    ///
    /// Without `-f`, reads the live cluster (kubeconfig as kubectl; the role in
    /// `deploy/rbac/dractl-explain.yaml` suffices).
    Simulate {
        /// Cluster file (Nodes, DeviceClasses, ResourceSlices, allocated ResourceClaims);
        /// repeatable. Without it, the live cluster.
        #[arg(short = 'f', long = "filename")]
        files: Vec<String>,
        /// A ResourceClaimTemplate (or ResourceClaim) file: one claim per template per pod;
        /// repeatable.
        #[arg(long = "claim-template", required_unless_present_any = ["pod_group", "job", "pending"])]
        templates: Vec<String>,
        /// Pods in the job (without a job: stop after this many pods).
        #[arg(long)]
        count: Option<usize>,
        /// A batch/v1 Job manifest: its parallelism is the pod count (unless --count), its pod
        /// template's resourceClaims the pods' claims (templates from this file or
        /// --claim-template; claims it names are shared by all pods); or a JobSet
        /// (jobset.x-k8s.io/v1alpha2), each replicated job replicas x parallelism pods with
        /// its own claims. The file may hold the ResourceClaimTemplates and ResourceClaims.
        /// Repeatable (one Job or JobSet in all).
        #[arg(long = "job")]
        job: Vec<String>,
        /// A gang: all pods or none (minCount = --count).
        #[arg(long, conflicts_with = "min_count")]
        gang: bool,
        /// A gang that needs at least this many pods placed (all or nothing below it).
        #[arg(long)]
        min_count: Option<usize>,
        /// Keep every pod within one domain: nodes sharing this label's value (a PodGroup's
        /// schedulingConstraints.topology[0].key, KEP-5732).
        #[arg(long)]
        topology_key: Option<String>,
        /// A PodGroup manifest (scheduling.k8s.io/v1alpha2, Kubernetes 1.36, or v1beta1,
        /// 1.37): its gang minCount, topology key and resourceClaims; the file may hold the
        /// ResourceClaimTemplates and ResourceClaims its claims name. Repeatable (one PodGroup in
        /// all).
        #[arg(long = "pod-group", conflicts_with_all = ["gang", "min_count", "topology_key"])]
        pod_group: Vec<String>,
        /// What was submitted to the live cluster: `podgroup/NAMESPACE/NAME` (its pending pods,
        /// those naming it in spec.schedulingGroup), `job/NAMESPACE/NAME` or
        /// `jobset/NAMESPACE/NAME` (one not yet running: suspended by Kueue, or just created),
        /// with the templates and claims its pods name, read from the cluster.
        #[arg(long, conflicts_with_all = ["files", "job", "pod_group", "templates"])]
        pending: Option<dractl::pending::Target>,
        /// Kubeconfig file (live cluster).
        #[arg(long)]
        kubeconfig: Option<std::path::PathBuf>,
        /// Kubeconfig context (live cluster).
        #[arg(long)]
        context: Option<String>,
        /// Output format.
        #[arg(short = 'o', long = "output", value_enum, default_value = "text")]
        output: dractl::explain::Format,
    },
    /// Who holds GPUs and does not use them: one line per pod with its claims' devices,
    /// utilization, memory used against its limit, idle time and its cost; idle pods first.
    ///
    /// Reads each node plugin's usage report through a port-forward opened by the API server
    /// (kubeconfig as kubectl), showing the plugin the user's bearer token; read-only, RBAC in
    /// `deploy/rbac/dractl-top.yaml`.
    Top {
        /// Only pods of this namespace (default: the kubeconfig context's, as kubectl).
        #[arg(short = 'n', long = "namespace", conflicts_with = "all_namespaces")]
        namespace: Option<String>,
        /// Pods of every namespace.
        #[arg(short = 'A', long = "all-namespaces")]
        all_namespaces: bool,
        /// Only idle pods.
        #[arg(long)]
        idle: bool,
        /// Price of one GPU for one hour: adds the cost of each pod's idle time.
        #[arg(long)]
        price_per_gpu_hour: Option<f64>,
        /// The namespace the node plugins run in (the chart's release namespace).
        #[arg(long, default_value = "drust-system")]
        plugin_namespace: String,
        /// The label selector of the node plugins' pods.
        #[arg(long, default_value = "app.kubernetes.io/component=kubelet-plugin")]
        plugin_selector: String,
        /// A file holding the bearer token to show the node plugins (e.g. from `kubectl create
        /// token`), for a kubeconfig user without one (client certificates); default: the
        /// kubeconfig user's.
        #[arg(long)]
        token_file: Option<std::path::PathBuf>,
        /// Kubeconfig file.
        #[arg(long)]
        kubeconfig: Option<std::path::PathBuf>,
        /// Kubeconfig context.
        #[arg(long)]
        context: Option<String>,
        /// Output format.
        #[arg(short = 'o', long = "output", value_enum, default_value = "text")]
        output: LintFormat,
    },
    /// Check ResourceClaims, ResourceClaimTemplates and DeviceClasses before applying them.
    ///
    /// Selectors compiled with the API server's rules (syntax, types, length, cost), attribute
    /// and capacity names checked against what the driver publishes (a typo gets the nearest
    /// name), opaque configs for the driver decoded strictly (ours and NVIDIA's
    /// resource.nvidia.com/v1beta1), and claims no known topology could satisfy. Workloads queued
    /// by Kueue (label kueue.x-k8s.io/queue-name) get warnings where Kueue refuses or does not
    /// check their claims (a claim named directly, firstAvailable, allocationMode All, a
    /// DeviceClass outside --kueue-config's mappings, a claim or constraint no node of --slices
    /// can satisfy). Other kinds in the files are skipped. Exit status 0 when clean or with
    /// warnings only, 1 with findings, 2 for unreadable input.
    Lint {
        /// Input file (`-` for stdin); repeatable.
        #[arg(short = 'f', long = "filename", required = true)]
        files: Vec<String>,
        /// The DRA driver: ours, or `gpu.nvidia.com` for NVIDIA compatibility mode (NVIDIA's
        /// device names and spellings).
        #[arg(long, default_value = "gpu.drust.dev")]
        driver_name: String,
        /// The cluster's published ResourceSlices (with its Nodes and DeviceClasses, as
        /// `kubectl get resourceslices,nodes,deviceclasses -o yaml` prints them); repeatable. A
        /// job queued by Kueue whose claim no node of them can satisfy (its NVLink
        /// matchAttribute, say) gets a warning: Kueue admits it anyway.
        #[arg(long = "slices")]
        slices: Vec<String>,
        /// Kueue's Configuration (or the ConfigMap holding it): a queued job's DeviceClass it
        /// does not map in deviceClassMappings gets a warning.
        #[arg(long = "kueue-config")]
        kueue_config: Option<String>,
        /// Output format.
        #[arg(short = 'o', long = "output", value_enum, default_value = "text")]
        output: LintFormat,
    },
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum LintFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum CelCommand {
    /// Evaluate a selector against a device, or a JSON Lines batch of cases.
    Eval {
        /// The selector expression.
        #[arg(long, required_unless_present = "batch")]
        expression: Option<String>,
        /// A device JSON file (ResourceSlice device fields).
        #[arg(long, requires = "expression")]
        device: Option<String>,
        /// JSON Lines file of cases (`-` for stdin).
        #[arg(long, conflicts_with = "expression")]
        batch: Option<String>,
        /// `stored` (scheduler) or `new` (API validation).
        #[arg(long)]
        environment: Option<String>,
    },
    /// Time compile and evaluation over a JSON Lines batch (same figures as the oracle's -bench).
    Bench {
        /// JSON Lines file of cases.
        #[arg(long)]
        batch: String,
        /// Iterations (evaluation runs 10x as many).
        #[arg(long, default_value_t = 3)]
        iterations: usize,
    },
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    if let Command::Allocate {
        files,
        node,
        output,
        timeout,
        fix_upstream_bug,
    } = &cli.command
    {
        let options = dractl::allocate::Options {
            node: node.clone(),
            timeout: *timeout,
            fix_distinct_attribute: fix_upstream_bug.iter().any(|b| b == "140438"),
        };
        std::process::exit(allocate(files, &options, *output));
    }
    if let Command::Explain {
        target,
        name,
        files,
        kubeconfig,
        context,
        node,
        output,
        timeout,
    } = &cli.command
    {
        let options = dractl::explain::Options {
            node: node.clone(),
            timeout: *timeout,
            fix_distinct_attribute: false,
        };
        let code = match (target, name) {
            (Some(target), Some(name)) => {
                let connection = dractl::live::Connection {
                    kubeconfig: kubeconfig.clone(),
                    context: context.clone(),
                };
                explain_live(&connection, *target, name, &options, *output)
            }
            _ => explain(files, &options, *output),
        };
        std::process::exit(code);
    }
    if let Command::Simulate {
        files,
        templates,
        count,
        job: job_files,
        gang,
        min_count,
        topology_key,
        pod_group,
        pending,
        kubeconfig,
        context,
        output,
    } = &cli.command
    {
        let connection = dractl::live::Connection {
            kubeconfig: kubeconfig.clone(),
            context: context.clone(),
        };
        let job = dractl::simulate::Job {
            count: *count,
            gang: *gang,
            min_count: *min_count,
            topology_key: topology_key.clone(),
        };
        let is_job = count.is_some()
            || !job_files.is_empty()
            || *gang
            || min_count.is_some()
            || topology_key.is_some()
            || !pod_group.is_empty()
            || pending.is_some();
        let code = if is_job {
            let input = JobInput {
                files,
                templates,
                pod_group,
                job_files,
                pending: pending.as_ref(),
            };
            simulate_job(&input, &job, &connection, *output)
        } else {
            simulate(files, templates, *count, &connection, *output)
        };
        std::process::exit(code);
    }
    if let Command::Top {
        namespace,
        all_namespaces,
        idle,
        price_per_gpu_hour,
        plugin_namespace,
        plugin_selector,
        token_file,
        kubeconfig,
        context,
        output,
    } = &cli.command
    {
        let connection = dractl::live::Connection {
            kubeconfig: kubeconfig.clone(),
            context: context.clone(),
        };
        let options = dractl::top::Options {
            scope: match (namespace, all_namespaces) {
                (_, true) => dractl::top::Scope::All,
                (Some(ns), false) => dractl::top::Scope::Namespace(ns.clone()),
                (None, false) => dractl::top::Scope::Context,
            },
            idle_only: *idle,
            price_per_gpu_hour: *price_per_gpu_hour,
            plugin_namespace: plugin_namespace.clone(),
            plugin_selector: plugin_selector.clone(),
            token_file: token_file.clone(),
        };
        let read =
            tokio::runtime::Runtime::new()?.block_on(dractl::top::run(&connection, &options));
        let code = match read {
            Ok(top) => {
                match output {
                    LintFormat::Text => print!("{}", top.text(price_per_gpu_hour.is_some())),
                    LintFormat::Json => println!("{}", serde_json::to_string_pretty(&top)?),
                }
                0
            }
            Err(e) => {
                eprintln!("dractl top: {e}");
                2
            }
        };
        std::process::exit(code);
    }
    if let Command::Lint {
        files,
        driver_name,
        slices,
        kueue_config,
        output,
    } = &cli.command
    {
        let context = (|| {
            Ok::<_, dractl::objects::InputError>(dractl::lint::Context {
                cluster: if slices.is_empty() {
                    None
                } else {
                    Some(dractl::kueue::Cluster::read(slices)?)
                },
                kueue: kueue_config
                    .as_deref()
                    .map(dractl::kueue::read_config)
                    .transpose()?,
            })
        })();
        let code = match context
            .and_then(|context| dractl::lint::lint_files_with(files, driver_name, &context))
        {
            Ok(report) => {
                let out = match output {
                    LintFormat::Text => report.text(),
                    LintFormat::Json => serde_json::to_string_pretty(&report)? + "\n",
                };
                print!("{out}");
                i32::from(report.failed())
            }
            Err(e) => {
                eprintln!("dractl lint: {e}");
                2
            }
        };
        std::process::exit(code);
    }
    if let Command::Cel {
        command: CelCommand::Bench { batch, iterations },
    } = &cli.command
    {
        let text = std::fs::read_to_string(batch).with_context(|| format!("read {batch}"))?;
        let lines: Vec<String> = text
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(String::from)
            .collect();
        println!(
            "{}",
            serde_json::to_string(&dractl::bench(&lines, *iterations))?
        );
        return Ok(());
    }
    match cli.command {
        Command::Allocate { .. }
        | Command::Explain { .. }
        | Command::Simulate { .. }
        | Command::Top { .. }
        | Command::Lint { .. } => {}
        Command::Cel {
            command: CelCommand::Bench { .. },
        } => {}
        Command::Cel {
            command:
                CelCommand::Eval {
                    expression,
                    device,
                    batch,
                    environment,
                },
        } => {
            let stdout = std::io::stdout();
            let mut out = stdout.lock();
            if let Some(path) = batch {
                if path == "-" {
                    dractl::eval_batch(std::io::stdin().lock(), &mut out)?;
                } else {
                    let f = std::fs::File::open(&path).with_context(|| format!("open {path}"))?;
                    dractl::eval_batch(BufReader::new(f), &mut out)?;
                }
            } else {
                let expression = expression.context("--expression is required")?;
                let device = device.context("--device is required")?;
                let outcome = dractl::eval_one(&expression, &device, environment)?;
                writeln!(out, "{}", serde_json::to_string(&outcome)?)?;
            }
        }
    }
    Ok(())
}

/// `dractl explain`: 0 when the run completed (whatever fits), 2 for bad input, 1 otherwise.
fn explain(
    files: &[String],
    options: &dractl::explain::Options,
    output: dractl::explain::Format,
) -> i32 {
    let report = match dractl::objects::load_files(files)
        .and_then(|inputs| dractl::explain::explain(inputs, options))
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("dractl explain: {e}");
            return 2;
        }
    };
    print("explain", dractl::explain::render(&report, output))
}

/// `dractl explain pod|claim NAMESPACE/NAME`: 0 when explained, 2 for a bad name, 1 when
/// the cluster cannot be read.
fn explain_live(
    connection: &dractl::live::Connection,
    target: dractl::live::Target,
    name: &str,
    options: &dractl::explain::Options,
    output: dractl::explain::Format,
) -> i32 {
    let loaded = match block_on("explain", dractl::live::load(connection, target, name)) {
        Ok(loaded) => loaded,
        Err(code) => return code,
    };
    let objects = match loaded {
        Ok(o) => o,
        Err(e @ dractl::live::LiveError::Name(_)) => {
            eprintln!("dractl explain: {e}");
            return 2;
        }
        Err(e) => {
            eprintln!("dractl explain: {e}");
            return 1;
        }
    };
    if let Some(node) = &options.node
        && !objects
            .nodes
            .iter()
            .any(|n| n.metadata.name.as_deref() == Some(node))
    {
        eprintln!("dractl explain: node {node:?} is not in the cluster");
        return 2;
    }
    let (report, _) = dractl::explain::explain_objects(&objects, options);
    print("explain", dractl::explain::render(&report, output))
}

/// The cluster for `dractl simulate`: the files, or the live cluster. `Err((code,
/// message))`: 2 for bad input, `unreadable` when the cluster cannot be read.
fn simulate_cluster(
    files: &[String],
    connection: &dractl::live::Connection,
    options: &dractl::allocate::Options,
    unreadable: i32,
) -> Result<dra_allocator::Objects, i32> {
    if files.is_empty() {
        let loaded = block_on("simulate", dractl::live::load_cluster(connection))?;
        loaded.map_err(|e| {
            eprintln!("dractl simulate: {e}");
            unreadable
        })
    } else {
        dractl::objects::load_files(files)
            .and_then(|inputs| dractl::allocate::objects(inputs, options))
            .map_err(|e| {
                eprintln!("dractl simulate: {e}");
                2
            })
    }
}

/// `dractl simulate`: 0 when simulated, 2 for bad input, 1 when the cluster cannot be read.
fn simulate(
    files: &[String],
    templates: &[String],
    count: Option<usize>,
    connection: &dractl::live::Connection,
    output: dractl::explain::Format,
) -> i32 {
    let templates = match dractl::simulate::templates(templates) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("dractl simulate: {e}");
            return 2;
        }
    };
    let options = dractl::allocate::Options::default();
    let cluster = match simulate_cluster(files, connection, &options, 1) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let simulation = dractl::simulate::simulate(cluster, &templates, count, &options);
    let rendered = match output {
        dractl::explain::Format::Text => Ok(dractl::simulate::text(&simulation)),
        dractl::explain::Format::Json => serde_json::to_string(&simulation)
            .map(|s| s + "\n")
            .map_err(|e| e.to_string()),
        dractl::explain::Format::Yaml => gpu_inventory::yaml::to_string(&simulation),
    };
    print("simulate", rendered)
}

/// Where `dractl simulate` reads a job from: files, or what was submitted to the cluster.
struct JobInput<'a> {
    files: &'a [String],
    templates: &'a [String],
    pod_group: &'a [String],
    job_files: &'a [String],
    pending: Option<&'a dractl::pending::Target>,
}

/// `dractl simulate` for a job: 0 when it fits, 1 when it does not, 2 when it cannot be
/// answered (bad input, the cluster cannot be read, the output cannot be written).
fn simulate_job(
    input: &JobInput<'_>,
    job: &dractl::simulate::Job,
    connection: &dractl::live::Connection,
    output: dractl::explain::Format,
) -> i32 {
    let JobInput {
        files,
        templates,
        pod_group,
        job_files,
        pending,
    } = *input;
    let read = (|| {
        let templates = if templates.is_empty() {
            Vec::new()
        } else {
            dractl::simulate::templates(templates)?
        };
        let group = if pod_group.is_empty() {
            None
        } else {
            Some(dractl::simulate::read_pod_group(pod_group)?)
        };
        let manifest = if job_files.is_empty() {
            None
        } else {
            Some(dractl::workload::read_job(job_files)?)
        };
        Ok::<_, dractl::objects::InputError>((templates, group, manifest))
    })();
    let (templates, mut group, mut manifest) = match read {
        Ok(r) => r,
        Err(e) => {
            eprintln!("dractl simulate: {e}");
            return 2;
        }
    };
    if let Some(target) = pending {
        match block_on("simulate", dractl::pending::load(connection, target)) {
            Ok(Ok(p)) => {
                manifest = Some(p.manifest);
                group = p.pod_group;
            }
            Ok(Err(e)) => {
                eprintln!("dractl simulate: {e}");
                return 2;
            }
            Err(_) => return 2,
        }
    }
    let options = dractl::allocate::Options::default();
    let cluster = match simulate_cluster(files, connection, &options, 2) {
        Ok(c) => c,
        Err(_) => return 2,
    };
    let simulation =
        match dractl::simulate::simulate_job(cluster, templates, group, manifest, job, &options) {
            Ok(s) => s,
            Err(e) => {
                eprintln!("dractl simulate: {e}");
                return 2;
            }
        };
    let rendered = match output {
        dractl::explain::Format::Text => Ok(dractl::simulate::job_text(&simulation)),
        dractl::explain::Format::Json => serde_json::to_string(&simulation)
            .map(|s| s + "\n")
            .map_err(|e| e.to_string()),
        dractl::explain::Format::Yaml => gpu_inventory::yaml::to_string(&simulation),
    };
    match print("simulate", rendered) {
        0 => i32::from(!simulation.placement.fits),
        _ => 2,
    }
}

/// Runs `future` on a runtime of its own (the live-cluster paths); `Err(1)` when no runtime
/// can be made, said on stderr as `dractl COMMAND: ...`.
fn block_on<T>(command: &str, future: impl Future<Output = T>) -> Result<T, i32> {
    match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => Ok(runtime.block_on(future)),
        Err(e) => {
            eprintln!("dractl {command}: {e}");
            Err(1)
        }
    }
}

/// Prints rendered output: 0; 1 when rendering failed (said on stderr) or stdout is gone.
fn print(command: &str, rendered: Result<String, String>) -> i32 {
    match rendered {
        Ok(text) => write_stdout(&text),
        Err(e) => {
            eprintln!("dractl {command}: {e}");
            1
        }
    }
}

/// Writes the output: 0, or 1 when stdout is gone.
fn write_stdout(text: &str) -> i32 {
    let mut out = std::io::stdout().lock();
    if out
        .write_all(text.as_bytes())
        .and_then(|()| out.flush())
        .is_err()
    {
        return 1;
    }
    0
}

/// `dractl allocate`: 0 when the run completed (whatever fits), 2 for bad input, 1 otherwise.
fn allocate(
    files: &[String],
    options: &dractl::allocate::Options,
    output: dractl::allocate::Format,
) -> i32 {
    let report = match dractl::objects::load_files(files)
        .and_then(|inputs| dractl::allocate::allocate(inputs, options))
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("dractl allocate: {e}");
            return 2;
        }
    };
    print("allocate", dractl::allocate::render(&report, output))
}
