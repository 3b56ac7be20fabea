// One factory per feedback kind, each defined in its own file. make_feedback() dispatches here.
#pragma once

#include <memory>

#include "gradcomp/feedback.h"
#include "gradcomp/spec.h"

namespace gradcomp {

std::unique_ptr<Feedback> make_no_feedback(Spec& spec);
std::unique_ptr<Feedback> make_error_feedback(Spec& spec);
std::unique_ptr<Feedback> make_dgc_feedback(Spec& spec);
std::unique_ptr<Feedback> make_nesterov_feedback(Spec& spec);

}  // namespace gradcomp
