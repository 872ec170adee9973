//! Slurm's books as the claimer reads them: at each look the world's view (what holds which
//! GPU, the first pending jobs in Slurm's order) becomes the in-memory Slurm the daemon's unit
//! tests use ([`Fake`]), the daemon's own [`Claimer::look`] runs over it (Slurm's reasons,
//! tags, gres types and pins as on a cluster), and the pins it wrote are read back as the
//! world takes them. The simulated nodes are `sim0`, `sim1`, ...; each job is tagged as
//! job_submit tags it, its application its `app=`.

use super::input::Table;
use super::model::JobRef;
use multiplex_protocol::gres::{gpu_type, split_gpu_type, type_of};
use multiplex_protocol::spec::{put_back_note, with_note, Spec, GATE_LICENSE};
use multiplexd::claimer::{Claimer, Scorer};
use multiplexd::slurm::{Fake, FakeState, Job, NodeInfo};

/// A simulated node's name.
pub(crate) fn node_name(n: usize) -> String {
    format!("sim{n}")
}

/// What the world shows one look.
pub(crate) struct View<'a> {
    /// Per node, per GPU, the jobs that hold it (running, or claimed and about to start).
    pub cluster: &'a [Vec<Vec<JobRef>>],
    /// The first pending jobs, in Slurm's order.
    pub pending: &'a [JobRef],
    /// Each job waits on one GPU index from its submission, as job_submit binds it where
    /// Slurm merges gres updates (22.05), and a claim chooses the node.
    pub fixed_gpu: bool,
}

/// One look of `claimer` at `now` over what the world shows, scored by `scorer`: the claims
/// as (pending index, node, GPU).
pub(crate) fn look(
    claimer: &mut Claimer,
    scorer: &dyn Scorer,
    names: &Names,
    view: View,
    now: f64,
) -> Result<Vec<(usize, usize, usize)>, String> {
    let pending = view.pending;
    let slurm = Fake::new(books(names, &view));
    let looked = claimer.look(&slurm, scorer, now).map_err(|e| e.to_string())?;
    // Every job of the trace fits some GPU alone: none has a place in it refused.
    if let Some((job, reason)) = looked.refused.first() {
        return Err(format!("job {job} refused: {reason}"));
    }
    let state = slurm.state.into_inner().unwrap_or_else(|p| p.into_inner());
    state
        .claims
        .iter()
        .map(|pin| {
            let index = pending.iter().position(|j| j.id == pin.job);
            let node = pin.node.strip_prefix("sim").and_then(|n| n.parse().ok());
            let gpu = pin.gres.as_deref().and_then(type_of).and_then(split_gpu_type);
            match (index, node, gpu) {
                (Some(i), Some(n), Some((_, g))) => Ok((i, n, g as usize)),
                _ => Err(format!("the claimer wrote a pin the world cannot read: {pin:?}")),
            }
        })
        .collect()
}

/// What Slurm's books name, written once per run: each application's tag (job_submit's), the
/// put-back note naming each application, each GPU's shard gres, each node's name and record.
pub(crate) struct Names {
    tags: Vec<String>,
    put_back: Vec<String>,
    shards: Vec<String>,
    nodes: Vec<NodeInfo>,
}

impl Names {
    pub(crate) fn new(table: &Table, nodes: usize, gpus: usize, slots: u32) -> Names {
        let tags: Vec<String> = table.apps.iter().map(|app| tag(app)).collect();
        // A job the daemon put back after it ran out of memory beside a partner: its tag with
        // the note saying so.
        let put_back = table.apps.iter().map(|app| put_back_note(app, "sim", "0")).collect();
        Names {
            tags,
            put_back,
            shards: (0..gpus as u32)
                .map(|g| format!("shard:{}:1", gpu_type(&table.model, g)))
                .collect(),
            nodes: (0..nodes).map(|n| node_info(&table.model, n, gpus, slots)).collect(),
        }
    }

    /// A job's admin comment.
    fn admin_comment(&self, j: &JobRef) -> Option<String> {
        Some(match j.put_back {
            Some(beside) => with_note(&self.tags[j.app], &self.put_back[beside]),
            None => self.tags[j.app].clone(),
        })
    }
}

/// The world's view as Slurm's books: running (or claimed) jobs on their typed GPU, pending
/// jobs waiting for the gate's license alone, every node up with its GPUs' gres.
fn books(names: &Names, view: &View) -> FakeState {
    let View {
        cluster,
        pending,
        fixed_gpu,
    } = *view;
    let shards = &names.shards;
    let gpus = shards.len();
    let mut jobs = Vec::with_capacity(pending.len() + cluster.len() * gpus * 2);
    for (n, node) in cluster.iter().enumerate() {
        for (g, residents) in node.iter().enumerate() {
            for r in residents {
                jobs.push(Job {
                    id: r.id,
                    pending: false,
                    reason: "None".into(),
                    node: Some(names.nodes[n].name.clone()),
                    excluded: None,
                    gres: shards[g].clone(),
                    licenses: String::new(),
                    admin_comment: names.admin_comment(r),
                });
            }
        }
    }
    for j in pending {
        jobs.push(Job {
            id: j.id,
            pending: true,
            reason: "Licenses".into(),
            node: None,
            excluded: None,
            // job_submit's rotation over the GPU indices, in submission order.
            gres: match fixed_gpu {
                true => shards[(j.id as usize - 1) % gpus].clone(),
                false => "shard:1".into(),
            },
            licenses: format!("{GATE_LICENSE}:1"),
            admin_comment: names.admin_comment(j),
        });
    }
    FakeState {
        jobs,
        nodes: names.nodes[..cluster.len()].to_vec(),
        merges: fixed_gpu,
        ..FakeState::default()
    }
}

/// job_submit's tag of a job of `app`.
fn tag(app: &str) -> String {
    Spec {
        app: Some(app.to_string()),
        ..Spec::default()
    }
    .tag()
}

/// A simulated node as sinfo lists it.
fn node_info(model: &str, n: usize, gpus: usize, slots: u32) -> NodeInfo {
    let each = |kind: &'static str, count: u32| {
        (0..gpus as u32).map(move |g| format!("{kind}:{}:{count}", gpu_type(model, g)))
    };
    NodeInfo {
        name: node_name(n),
        state: "mixed".into(),
        gres: each("gpu", 1).chain(each("shard", slots)).collect::<Vec<_>>().join(","),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use multiplexd::config::ClaimConfig;
    use multiplexd::placement::{Estimates, Knobs, Wanted};
    use std::collections::HashMap;

    /// Knows nothing of any pair: the claimer spreads.
    struct Blank;

    impl Scorer for Blank {
        fn gpu_memory(&self) -> HashMap<String, u64> {
            HashMap::new()
        }
        fn app_memory(&self) -> Result<HashMap<String, u64>, String> {
            Ok(HashMap::new())
        }
        fn knobs(&self) -> Knobs {
            Knobs {
                slots: 2,
                unknown_pair_speed: 0.5,
                min_gain: 0.25,
                separate_below: 0.0,
            }
        }
        fn estimates(&self, _: &Wanted) -> Result<Estimates, String> {
            Ok(Estimates::default())
        }
    }

    fn table() -> Table {
        Table::parse("gpu,job_a,job_b,speed_a,speed_b\nv100,a,a,0.5,0.5\n", "t").unwrap()
    }

    #[test]
    fn the_claimer_reads_the_worlds_view_as_slurms_books_and_its_pins_come_back() {
        let table = table();
        // Two nodes of two GPUs: node 0's GPU 0 and node 1's GPU 1 hold a job each.
        let job = |id| JobRef {
            id,
            app: 0,
            put_back: None,
        };
        let cluster = vec![vec![vec![job(1)], vec![]], vec![vec![], vec![job(2)]]];
        let pending = [job(3), job(4), job(5)];
        let view = View {
            cluster: &cluster,
            pending: &pending,
            fixed_gpu: false,
        };
        let mut claimer = Claimer::new(ClaimConfig::default(), 1);
        let pins = look(&mut claimer, &Blank, &Names::new(&table, 2, 2, 2), view, 0.0).unwrap();
        // The two idle GPUs first, in Slurm's order, then a share of the first GPU that holds
        // one job (a pair never seen is tried).
        assert_eq!(pins, vec![(0, 0, 1), (1, 1, 0), (2, 0, 0)]);
    }

    #[test]
    fn where_jobs_are_bound_to_a_gpu_index_a_claim_chooses_only_the_node() {
        let table = table();
        let job = |id| JobRef {
            id,
            app: 0,
            put_back: None,
        };
        // Job 3 is bound to GPU 0 ((3 - 1) % 2), held on node 0 and idle on node 1.
        let cluster = vec![vec![vec![job(1)], vec![]], vec![vec![], vec![job(2)]]];
        let view = View {
            cluster: &cluster,
            pending: &[job(3)],
            fixed_gpu: true,
        };
        let mut claimer = Claimer::new(ClaimConfig::default(), 1);
        let pins = look(&mut claimer, &Blank, &Names::new(&table, 2, 2, 2), view, 0.0).unwrap();
        assert_eq!(pins, vec![(0, 1, 0)]);
    }

    #[test]
    fn a_table_whose_names_could_not_travel_in_a_tag_is_refused() {
        let bad = Table::parse("gpu,job_a,job_b,speed_a,speed_b\nv100,a b,a b,0.5,0.5\n", "t");
        assert!(bad.unwrap_err().contains("app name 'a b' is invalid"));
        let bad = Table::parse("gpu,job_a,job_b,speed_a,speed_b\nv 100,a,a,0.5,0.5\n", "t");
        assert!(bad.unwrap_err().contains("GPU model \"v 100\""));
    }
}
