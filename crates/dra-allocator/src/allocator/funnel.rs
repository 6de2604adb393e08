//! The explanation of a node where the search found no solution ([`crate::explain`]): each
//! request's funnel, computed by the search that decided, with its own checks, after it
//! rolled every tentative allocation back.

use std::sync::Arc;

use k8s_openapi::api::resource::v1::DeviceSelector;

use super::{
    AllocateError, ClaimData, Compiled, DevRef, Indices, Location, RequestData, RequestSlot,
    Search, SelectorInput,
};
use crate::attributes::{Value, lookup};
use crate::explain::{
    AttributeValues, Competition, EXAMPLES, Explanation, Needed, RequestFunnel, SelectorEffect,
    SkippedPool, Stage, StageResult, ValueCount,
};
use crate::node_selector::node_matches;

/// Devices kept at the end of a funnel, listed for competition (at most this many names).
const CANDIDATE_NAMES: usize = 32;

/// One stage's filtering: the devices kept and what the stage reports.
struct Filtered {
    kept: Vec<DevRef>,
    result: StageResult,
}

impl<'s, 'a: 's, 'i> Search<'s, 'a, 'i> {
    /// Why the claims do not fit here. Call after [`Search::run`] found no solution: the
    /// search state is then as it was before the search (every device rolled back).
    pub(super) fn explain(&mut self) -> Explanation {
        let skipped_pools = self
            .pools
            .iter()
            .filter_map(|p| {
                let reason = if p.incomplete {
                    "incomplete"
                } else if p.invalid {
                    "invalid"
                } else {
                    return None;
                };
                Some(SkippedPool {
                    pool: p.id(),
                    reason,
                })
            })
            .collect();
        let mut offered = Vec::new();
        let mut at = Location::default();
        while let Some((dev, next)) = self.device_from(at) {
            offered.push(dev);
            at = next;
        }
        let claims = Arc::clone(&self.claims);
        let mut requests = Vec::new();
        // Per funnel: (claim, request) index and the devices left.
        let mut finals: Vec<((usize, usize), Vec<DevRef>)> = Vec::new();
        for (ci, claim) in claims.iter().enumerate() {
            for (ri, slot) in claim.requests.iter().enumerate() {
                for (si, rd) in slot.subs.iter().enumerate() {
                    let r = Indices {
                        claim: ci,
                        request: ri,
                        sub: si,
                        device: 0,
                    };
                    let (funnel, left) = self.funnel(r, claim, rd, &offered);
                    requests.push(funnel);
                    finals.push(((ci, ri), left));
                }
            }
        }
        let mut explanation = Explanation {
            reason: String::new(),
            skipped_pools,
            requests,
            competition: Vec::new(),
        };
        explanation.reason = match blocked_request(&explanation) {
            Some(reason) => reason,
            None => self.together(&mut explanation, &finals),
        };
        explanation
    }

    /// One (sub)request's funnel and the devices left at its end.
    fn funnel(
        &mut self,
        r: Indices,
        claim: &ClaimData<'s>,
        rd: &RequestData<'s>,
        offered: &[DevRef],
    ) -> (RequestFunnel, Vec<DevRef>) {
        let alloc = self.alloc;
        let features = alloc.features;
        let mut stages = Vec::new();

        // What the node offers this request (isSelectable's checks that are not selectors).
        let mut left = Vec::new();
        let mut errors = Vec::new();
        for &dev in offered {
            let Some((slice, device)) = alloc.device(dev.slice, dev.device) else {
                continue;
            };
            if !features.device_binding_and_status && device.has_binding_conditions {
                continue;
            }
            if slice.per_device_node_selection {
                match node_matches(
                    self.node,
                    device.obj.node_name.as_deref().unwrap_or(""),
                    device.obj.all_nodes.unwrap_or(false),
                    device.obj.node_selector.as_ref(),
                ) {
                    Ok(true) => {}
                    Ok(false) => continue,
                    Err(e) => {
                        push_capped(&mut errors, format!("{}: {e}", self.device_name(dev)));
                        continue;
                    }
                }
            }
            left.push(dev);
        }
        stages.push(StageResult {
            stage: Stage::Offered,
            left: left.len(),
            removed: 0,
            examples: Vec::new(),
            selectors: Vec::new(),
            errors,
        });

        let class_selectors = rd.class.spec.selectors.as_deref().unwrap_or_default();
        let step = self.selector_stage(
            Stage::ClassSelectors,
            &left,
            &rd.selectors.class_cel,
            class_selectors,
        );
        left = step.kept;
        stages.push(step.result);

        let step = self.selector_stage(
            Stage::RequestSelectors,
            &left,
            &rd.selectors.request_cel,
            request_selectors(claim, r),
        );
        left = step.kept;
        stages.push(step.result);

        let step = self.filter(Stage::NotInUse, &left, |this, dev| {
            (!this.taken(dev.flat, r.claim, rd.admin))
                .then_some(())
                .ok_or(None)
        });
        left = step.kept;
        stages.push(step.result);

        let step = self.filter(Stage::TaintsTolerated, &left, |this, dev| {
            let Some((_, device)) = this.alloc.device(dev.slice, dev.device) else {
                return Err(None);
            };
            if !features.device_taints || !this.taint_prevents(device, r) {
                return Ok(());
            }
            let taint = device
                .taints
                .iter()
                .find(|t| matches!(t.effect.as_str(), "NoExecute" | "NoSchedule"))
                .map(|t| {
                    format!(
                        " ({}={}:{})",
                        t.key,
                        t.value.as_deref().unwrap_or(""),
                        t.effect
                    )
                })
                .unwrap_or_default();
            Err(Some(taint))
        });
        left = step.kept;
        stages.push(step.result);

        let step = self.filter(Stage::CountersAndCapacity, &left, |this, dev| {
            if features.consumable_capacity
                && this.capacity_fits(rd.capacity.as_ref(), dev) != Ok(true)
            {
                let why = this
                    .capacity_shortfall(rd.capacity.as_ref(), dev)
                    .unwrap_or_else(|| "capacity".into());
                return Err(Some(format!(" ({why})")));
            }
            let Some((slice, device)) = this.alloc.device(dev.slice, dev.device) else {
                return Err(None);
            };
            let consumes = slice.consumes_counters && !device.consumes_counters.is_empty();
            if !consumes {
                return Ok(());
            }
            if !features.partitionable_devices {
                return Err(Some(
                    " (consumes counters; partitionable devices off)".into(),
                ));
            }
            let allow_multiple = features.consumable_capacity && device.allow_multiple;
            if allow_multiple && this.capacity_in_use(dev.flat) {
                return Ok(());
            }
            if this.reserve_counters(dev) {
                this.release_counters(dev);
                Ok(())
            } else {
                Err(Some(" (counters)".into()))
            }
        });
        left = step.kept;
        stages.push(step.result);

        let needed = if rd.all_mode {
            Needed::All(rd.all_devices.len())
        } else {
            Needed::Count(usize::try_from(rd.num_devices).unwrap_or(0))
        };

        // The claim's constraints on this request.
        let (base, sub) = match rd.parent {
            Some(p) => (p, Some(rd.name)),
            None => (rd.name, None),
        };
        let mut constraints = Vec::new();
        let mut most = None::<usize>;
        for c in self.constraints.get(r.claim).into_iter().flatten() {
            if !c.applies_to(base, sub) {
                continue;
            }
            let (kind, attribute) = c.describe();
            let mut values: Vec<(Value<'_>, usize)> = Vec::new();
            let mut without = 0;
            // Upstream's distinctAttribute (kubernetes/kubernetes#140438) compares a request's
            // next device with its last one only, so in search order a request can take one
            // device of each run of equal values.
            let mut runs = 0;
            let mut last = None;
            for &dev in &left {
                let Some((slice, device)) = alloc.device(dev.slice, dev.device) else {
                    continue;
                };
                let attributes = slice.attributes.device(device.attributes.clone());
                match lookup(attributes, slice.driver, attribute) {
                    None => without += 1,
                    Some(v) => {
                        if v != Value::Unknown && last != Some(v) {
                            runs += 1;
                            last = Some(v);
                        }
                        match values.iter_mut().find(|(seen, _)| *seen == v) {
                            Some((_, n)) => *n += 1,
                            None => values.push((v, 1)),
                        }
                    }
                }
            }
            // A value-less attribute never equals another (upstream compares it as unequal),
            // so such devices serve at most one device's worth.
            let unknown = values
                .iter()
                .find(|(v, _)| *v == Value::Unknown)
                .map_or(0, |(_, n)| *n);
            let known = values.iter().filter(|(v, _)| *v != Value::Unknown);
            let usable = if kind == "matchAttribute" {
                known
                    .map(|(_, n)| *n)
                    .max()
                    .unwrap_or(0)
                    .max(unknown.min(1))
            } else if c.loosens_on_removal() {
                runs + unknown.min(1)
            } else {
                known.count() + unknown.min(1)
            };
            most = Some(most.map_or(usable, |m| m.min(usable)));
            constraints.push(AttributeValues {
                constraint: kind,
                attribute: attribute.to_string(),
                values: values
                    .iter()
                    .map(|(v, n)| ValueCount {
                        value: v.to_string(),
                        devices: *n,
                    })
                    .collect(),
                without,
            });
        }
        if let Some(most) = most {
            stages.push(StageResult {
                stage: Stage::Constraint,
                left: most,
                removed: left.len().saturating_sub(most),
                examples: Vec::new(),
                selectors: Vec::new(),
                errors: Vec::new(),
            });
        }

        let mut blocked_at = stages
            .iter()
            .find(|s| s.left < needed.devices())
            .map(|s| s.stage);
        if blocked_at.is_none() {
            match self.fits_alone(r, claim, rd) {
                Ok(true) => {}
                Ok(false) => blocked_at = Some(Stage::Combination),
                // Alone, the request meets an error the search with every request did not
                // reach (devices it never checked): blame the stage that recorded it.
                Err(()) => {
                    blocked_at = stages
                        .iter()
                        .find(|s| !s.errors.is_empty())
                        .map_or(Some(Stage::Combination), |s| Some(s.stage));
                }
            }
        }
        let request = match rd.parent {
            Some(p) => format!("{p}/{}", rd.name),
            None => rd.name.to_string(),
        };
        let candidates = left
            .iter()
            .take(CANDIDATE_NAMES)
            .map(|&d| self.device_name(d))
            .collect();
        let funnel = RequestFunnel {
            claim: claim.kobj.clone(),
            request,
            device_class: rd.class.metadata.name.clone().unwrap_or_default(),
            needed,
            stages,
            blocked_at,
            constraints,
            candidates,
        };
        (funnel, left)
    }

    /// Whether the (sub)request, as the only request of its claim and with the claim's
    /// constraints on it, finds devices: the search itself, on this node's pools and
    /// allocated state. `Err` where that search ends in an error of the input (a CEL runtime
    /// error); a search cut short (deadline, cancellation) counts as fitting, so that the
    /// explanation does not blame the request for it.
    fn fits_alone(
        &self,
        r: Indices,
        claim: &ClaimData<'s>,
        rd: &RequestData<'s>,
    ) -> Result<bool, ()> {
        let (base, sub) = match rd.parent {
            Some(p) => (p, Some(rd.name)),
            None => (rd.name, None),
        };
        let constraints = self
            .constraints
            .get(r.claim)
            .into_iter()
            .flatten()
            .filter(|c| c.applies_to(base, sub))
            .cloned()
            .collect();
        let mut search = Search::new(
            self.alloc,
            self.node,
            Arc::new(vec![claim.kobj.clone()]),
            self.pools.clone(),
            self.interrupt,
        );
        search.claims = Arc::new(vec![ClaimData {
            obj: claim.obj,
            kobj: claim.kobj.clone(),
            requests: vec![RequestSlot {
                subs: vec![rd.clone()],
                has_subrequests: false,
            }],
        }]);
        search.constraints = vec![constraints];
        match search.run() {
            Ok(found) => Ok(found.is_some()),
            Err(AllocateError::TimedOut | AllocateError::Cancelled) => Ok(true),
            Err(AllocateError::Fatal(_) | AllocateError::FailedOnNode(_)) => Err(()),
        }
    }

    /// The devices of `left` that every selector accepts, evaluated one selector at a time
    /// (each device counts for the first selector that rejects it).
    fn selector_stage(
        &self,
        stage: Stage,
        left: &[DevRef],
        compiled: &[Option<Compiled>],
        selectors: &[DeviceSelector],
    ) -> Filtered {
        let mut kept = Vec::with_capacity(left.len());
        let mut removed_by = vec![0usize; compiled.len()];
        let mut examples = Vec::new();
        let mut errors = Vec::new();
        for &dev in left {
            let Some((slice, device)) = self.alloc.device(dev.slice, dev.device) else {
                continue;
            };
            let input = SelectorInput {
                attributes: slice.attributes.device(device.attributes.clone()),
                driver: slice.driver,
                device,
            };
            let mut rejected = None;
            for (i, c) in compiled.iter().enumerate() {
                let verdict = match c {
                    None => Err("CEL expression empty (unsupported selector type?)".to_string()),
                    Some(Err(e)) => Err(format!("CEL compile error: {e}")),
                    Some(Ok(c)) => self
                        .selector_matches(c, input)
                        .map_err(|e| format!("CEL runtime error: {e}")),
                };
                match verdict {
                    Ok(true) => {}
                    Ok(false) => {
                        rejected = Some(i);
                        break;
                    }
                    Err(e) => {
                        push_capped(
                            &mut errors,
                            format!("selector #{i} on {}: {e}", self.device_name(dev)),
                        );
                        rejected = Some(i);
                        break;
                    }
                }
            }
            match rejected {
                None => kept.push(dev),
                Some(i) => {
                    if let Some(n) = removed_by.get_mut(i) {
                        *n += 1;
                    }
                    push_capped(&mut examples, self.device_name(dev));
                }
            }
        }
        let selectors = removed_by
            .iter()
            .enumerate()
            .filter(|(_, n)| **n > 0)
            .map(|(i, n)| SelectorEffect {
                expression: selectors
                    .get(i)
                    .and_then(|s| s.cel.as_ref())
                    .map(|c| c.expression.clone())
                    .unwrap_or_default(),
                removed: *n,
            })
            .collect();
        Filtered {
            result: StageResult {
                stage,
                left: kept.len(),
                removed: left.len() - kept.len(),
                examples,
                selectors,
                errors,
            },
            kept,
        }
    }

    /// The devices of `left` that `check` accepts; `Err(Some(note))` adds the note to the
    /// device's name in the examples.
    fn filter(
        &mut self,
        stage: Stage,
        left: &[DevRef],
        mut check: impl FnMut(&mut Self, DevRef) -> Result<(), Option<String>>,
    ) -> Filtered {
        let mut kept = Vec::with_capacity(left.len());
        let mut examples = Vec::new();
        for &dev in left {
            match check(self, dev) {
                Ok(()) => kept.push(dev),
                Err(note) => push_capped(
                    &mut examples,
                    format!("{}{}", self.device_name(dev), note.unwrap_or_default()),
                ),
            }
        }
        Filtered {
            result: StageResult {
                stage,
                left: kept.len(),
                removed: left.len() - kept.len(),
                examples,
                selectors: Vec::new(),
                errors: Vec::new(),
            },
            kept,
        }
    }

    /// Every request fits alone: which ones want the same devices, or what else ties them.
    fn together(
        &self,
        explanation: &mut Explanation,
        finals: &[((usize, usize), Vec<DevRef>)],
    ) -> String {
        // Per request, the funnel the search would use: the request itself, or its first
        // subrequest that fits alone.
        let mut chosen: Vec<(usize, &[DevRef])> = Vec::new();
        let mut seen: Vec<(usize, usize)> = Vec::new();
        for (i, ((key, left), funnel)) in finals.iter().zip(&explanation.requests).enumerate() {
            if seen.contains(key) || funnel.blocked_at.is_some() {
                continue;
            }
            seen.push(*key);
            chosen.push((i, left));
        }
        let label = |i: usize| {
            explanation.requests.get(i).map_or(String::new(), |f| {
                format!("claim {}, request {}", f.claim, f.request)
            })
        };
        let needs = |i: usize| {
            explanation
                .requests
                .get(i)
                .map_or(0, |f| f.needed.devices())
        };
        let mut competition = Vec::new();
        for (x, &(i, a)) in chosen.iter().enumerate() {
            for &(j, b) in chosen.iter().skip(x + 1) {
                let shared: Vec<DevRef> = a
                    .iter()
                    .filter(|d| b.iter().any(|e| e.flat == d.flat))
                    .copied()
                    .collect();
                if shared.is_empty() {
                    continue;
                }
                let available = a.len() + b.len() - shared.len();
                let needed = needs(i) + needs(j);
                if needed <= available {
                    continue;
                }
                competition.push(Competition {
                    requests: vec![label(i), label(j)],
                    needed,
                    available,
                    shared: shared
                        .iter()
                        .take(EXAMPLES)
                        .map(|&d| self.device_name(d))
                        .collect(),
                });
            }
        }
        let reason = if let Some(c) = competition.first() {
            format!(
                "every request fits alone, but not together: {} need {} devices and can use only {}",
                c.requests.join(" and "),
                c.needed,
                c.available,
            )
        } else if let Some(c) = self.cross_request_constraint(&chosen, explanation) {
            format!("every request fits alone, but not together: {c}")
        } else if chosen.iter().any(|(_, left)| {
            left.iter().any(|d| {
                self.alloc
                    .device(d.slice, d.device)
                    .is_some_and(|(_, dev)| !dev.consumes_counters.is_empty())
            })
        }) {
            "every request fits alone, but not together: their devices draw on the same counters (partitionable devices) and no combination leaves enough for all".into()
        } else {
            "every request fits alone, but no combination of devices satisfies all requests and constraints together".into()
        };
        explanation.competition = competition;
        reason
    }

    /// A constraint over several of the chosen requests, described with its values.
    fn cross_request_constraint(
        &self,
        chosen: &[(usize, &[DevRef])],
        explanation: &Explanation,
    ) -> Option<String> {
        for (ci, constraints) in self.constraints.iter().enumerate() {
            for c in constraints {
                let covered: Vec<&(usize, &[DevRef])> = chosen
                    .iter()
                    .filter(|(i, _)| {
                        explanation.requests.get(*i).is_some_and(|f| {
                            let (base, sub) = match f.request.split_once('/') {
                                Some((b, s)) => (b, Some(s)),
                                None => (f.request.as_str(), None),
                            };
                            self.claims.get(ci).is_some_and(|cd| cd.kobj == f.claim)
                                && c.applies_to(base, sub)
                        })
                    })
                    .collect();
                if covered.len() < 2 {
                    continue;
                }
                let (kind, attribute) = c.describe();
                let names: Vec<String> = covered
                    .iter()
                    .filter_map(|(i, _)| explanation.requests.get(*i))
                    .map(|f| format!("{} (needs {})", f.request, f.needed.devices()))
                    .collect();
                let claim = self.claims.get(ci).map_or("", |cd| cd.kobj.as_str());
                return Some(format!(
                    "claim {claim}: {kind} {attribute} over requests {} leaves no combination",
                    names.join(", ")
                ));
            }
        }
        None
    }

    /// `pool/device`.
    fn device_name(&self, dev: DevRef) -> String {
        match self.alloc.device(dev.slice, dev.device) {
            Some((slice, device)) => format!(
                "{}/{}",
                slice.pool,
                slice
                    .names
                    .get(device.name_at.clone())
                    .unwrap_or(device.name)
            ),
            None => String::new(),
        }
    }
}

/// The selectors of (sub)request `r` of a claim, as written.
fn request_selectors<'c>(claim: &ClaimData<'c>, r: Indices) -> &'c [DeviceSelector] {
    let Some(request) = claim
        .obj
        .spec
        .devices
        .as_ref()
        .and_then(|d| d.requests.as_ref())
        .and_then(|rs| rs.get(r.request))
    else {
        return &[];
    };
    let selectors = match &request.exactly {
        Some(exactly) if request.first_available.as_ref().is_none_or(Vec::is_empty) => {
            exactly.selectors.as_deref()
        }
        _ => request
            .first_available
            .as_ref()
            .and_then(|subs| subs.get(r.sub))
            .and_then(|s| s.selectors.as_deref()),
    };
    selectors.unwrap_or_default()
}

/// The reason of the first request none of whose (sub)requests fits alone.
fn blocked_request(explanation: &Explanation) -> Option<String> {
    for (claim, request, funnels) in explanation.by_request() {
        if funnels.iter().any(|f| f.blocked_at.is_none()) {
            continue;
        }
        let reason = match funnels.as_slice() {
            [one] if !one.request.contains('/') => one.blocked_reason().unwrap_or_default(),
            subs => {
                let each: Vec<String> = subs
                    .iter()
                    .map(|f| {
                        let sub = f.request.split_once('/').map_or("", |(_, s)| s);
                        format!("{sub}: {}", f.blocked_reason().unwrap_or_default())
                    })
                    .collect();
                format!("no subrequest fits ({})", each.join("; "))
            }
        };
        return Some(format!("claim {claim}, request {request}: {reason}"));
    }
    None
}

fn push_capped(list: &mut Vec<String>, item: String) {
    if list.len() < EXAMPLES {
        list.push(item);
    }
}
