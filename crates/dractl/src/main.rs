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
